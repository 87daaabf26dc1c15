"""nanoGPT's model layout: one explicit table between its ``state_dict`` and :class:`~qkv.models.GPT`'s params.

nanoGPT's ``model.py`` (``GPT``, ``Block``, ``CausalSelfAttention``, ``MLP``) names its
tensors as PyTorch modules do; ``nn.Linear`` stores its weight as ``(out, in)`` and computes
``x @ W.T + b``, where qkv stores ``(in, out)`` and computes ``x @ W + b``, so every linear
weight is transposed at this boundary and nowhere else. The fused ``c_attn`` weight
``(3C, C)`` holds the query, key and value projections as row blocks (``q, k, v =
c_attn(x).split(C, dim=2)``)::

    nanoGPT                                  shape         qkv
    transformer.wte.weight                   (V, C)        transformer.wte.weight
    transformer.wpe.weight                   (T, C)        transformer.wpe.weight
    transformer.h.{i}.ln_1.weight / .bias    (C,)          transformer.h.{i}.ln_1.weight / .bias
    transformer.h.{i}.attn.c_attn.weight     (3C, C)       rows [0:C], [C:2C], [2C:3C], each
                                                            transposed: attn.W_Q, W_K, W_V (C, C)
    transformer.h.{i}.attn.c_attn.bias       (3C,)         attn.b_Q, b_K, b_V
    transformer.h.{i}.attn.c_proj.weight     (C, C)        attn.W_O (transposed); .bias: attn.b_O
    transformer.h.{i}.ln_2.weight / .bias    (C,)          transformer.h.{i}.ln_2.weight / .bias
    transformer.h.{i}.mlp.c_fc.weight        (4C, C)       mlp.W_fc (C, 4C); .bias: mlp.b_fc
    transformer.h.{i}.mlp.c_proj.weight      (C, 4C)       mlp.W_proj (4C, C); .bias: mlp.b_proj
    transformer.ln_f.weight / .bias          (C,)          transformer.ln_f.weight / .bias
    lm_head.weight                           (V, C)        tied to wte: checked equal, stored once

The biases exist with ``bias=True`` only (nanoGPT's LayerNorm and Linear drop them
together). Keys may carry ``_orig_mod.`` (``torch.compile``'s wrapper), stripped as nanoGPT's
``sample.py`` strips it; an ``attn.bias`` causal-mask buffer (nanoGPT without flash
attention) is checked for shape and dropped.

nanoGPT's architecture is GPT-2's with the exact GELU (``nn.GELU()``), a tied head, an MLP of
``4 C``, LayerNorm eps 1e-5 and learned positions: a qkv model that is anything else is
refused by :func:`nanogpt_refusals`, naming what nanoGPT cannot hold. NumPy only; the
``ckpt.pt`` files themselves are :mod:`qkv.io.convert`'s.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, fmt_shape
from .checkpoint import CheckpointError

MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
COMPILED = "_orig_mod."  # the prefix torch.compile's OptimizedModule gives every key


def nanogpt_table(cfg) -> list[tuple[str, tuple, list[tuple[str, slice]], bool]]:
    """Every tensor of nanoGPT's ``state_dict`` for ``cfg`` (a :class:`GPTConfig`), in its order:
    ``(name, shape, [(our name, rows), ...], linear)``; ``linear``: an ``nn.Linear`` weight,
    whose row block is our matrix transposed. ``lm_head.weight`` (tied) is left out."""
    c, v, every = cfg.n_embd, cfg.vocab_size, slice(None)
    rows = [("transformer.wte.weight", (v, c), [("transformer.wte.weight", every)], False),
            ("transformer.wpe.weight", (cfg.block_size, c), [("transformer.wpe.weight", every)], False)]
    thirds = [slice(j * c, (j + 1) * c) for j in range(3)]

    def norm(name, ours):
        out = [(f"{name}.weight", (c,), [(f"{ours}.weight", every)], False)]
        return out + ([(f"{name}.bias", (c,), [(f"{ours}.bias", every)], False)] if cfg.bias else [])

    def linear(name, shape, weights, biases):
        out = [(f"{name}.weight", shape, weights, True)]
        return out + ([(f"{name}.bias", shape[:1], biases, False)] if cfg.bias else [])

    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        rows += norm(f"{h}ln_1", f"{h}ln_1")
        rows += linear(f"{h}attn.c_attn", (3 * c, c), [(f"{h}attn.W_{n}", s) for n, s in zip("QKV", thirds)],
                       [(f"{h}attn.b_{n}", s) for n, s in zip("QKV", thirds)])
        rows += linear(f"{h}attn.c_proj", (c, c), [(f"{h}attn.W_O", every)], [(f"{h}attn.b_O", every)])
        rows += norm(f"{h}ln_2", f"{h}ln_2")
        rows += linear(f"{h}mlp.c_fc", (4 * c, c), [(f"{h}mlp.W_fc", every)], [(f"{h}mlp.b_fc", every)])
        rows += linear(f"{h}mlp.c_proj", (c, 4 * c), [(f"{h}mlp.W_proj", every)], [(f"{h}mlp.b_proj", every)])
    rows += norm("transformer.ln_f", "transformer.ln_f")
    return rows


def gpt2_shape_refusals(cfg, target: str) -> list[str]:
    """What of ``cfg`` a GPT-2-shaped model (nanoGPT's, transformers' GPT-2: ``target``) cannot
    compute whatever its options: other mixers than attention, positions, grouped heads."""
    out = []
    kinds = sorted({k for k in cfg.layer_kinds if k != "attention"})
    if kinds:
        out.append(f"layers {cfg.layers!r} (a hybrid model: {', '.join(kinds)}; {target} has softmax attention "
                   f"in every block)")
    if cfg.positions != "learned":
        out.append(f"positions {cfg.positions!r} ({target} learns a position table, wpe)")
    if cfg.n_kv_head not in (None, cfg.n_head):
        out.append(f"n_kv_head {cfg.n_kv_head} (grouped key/value heads; {target} has n_head of each)")
    return out


def nanogpt_refusals(cfg) -> list[str]:
    """What of ``cfg`` (a :class:`GPTConfig`) nanoGPT's model cannot compute; empty when it can."""
    out = gpt2_shape_refusals(cfg, "nanoGPT")
    if cfg.activation != "gelu":
        out.append(f"activation {cfg.activation!r} (nanoGPT's MLP is nn.GELU(), the exact GELU: train with "
                   f"--activation gelu)")
    if not cfg.tie_weights:
        out.append("an untied head (nanoGPT ties lm_head to wte)")
    if cfg.n_inner not in (None, 4 * cfg.n_embd):
        out.append(f"n_inner {cfg.n_inner} (nanoGPT's MLP is 4 n_embd = {4 * cfg.n_embd} wide)")
    if cfg.layer_norm_eps != 1e-5:
        out.append(f"layer_norm_eps {cfg.layer_norm_eps} (nanoGPT's LayerNorm uses 1e-5)")
    return out


def model_args(cfg) -> dict:
    """nanoGPT's ``model_args`` (its ``GPTConfig(**model_args)``) of ``cfg``."""
    return {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "block_size": cfg.block_size,
            "bias": bool(cfg.bias), "vocab_size": cfg.vocab_size, "dropout": float(cfg.dropout)}


def config_of(args, where: str, dtype=np.float32):
    """The :class:`GPTConfig` of nanoGPT's ``model_args``; a CheckpointError naming a bad field."""
    from ..models.gpt import GPTConfig

    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: model_args must be a dict ({', '.join(MODEL_ARGS)}); got "
                              f"{type(args).__name__}")
    missing = [k for k in MODEL_ARGS if k not in args]
    if missing:
        raise CheckpointError(f"{where}: model_args lacks {', '.join(missing)} (nanoGPT's train.py saves "
                              f"{', '.join(MODEL_ARGS)})")
    if not isinstance(args["bias"], bool):
        raise CheckpointError(f"{where}: model_args bias must be True or False; got {args['bias']!r}")
    try:
        return GPTConfig(vocab_size=args["vocab_size"], block_size=args["block_size"], n_layer=args["n_layer"],
                         n_head=args["n_head"], n_embd=args["n_embd"], dropout=float(args["dropout"]),
                         bias=args["bias"], activation="gelu", dtype=dtype)
    except (ShapeError, TypeError, ValueError, OverflowError) as err:
        raise CheckpointError(f"{where}: model_args: {err}") from None


def to_nanogpt(arrays: dict, cfg) -> dict:
    """``arrays`` named as qkv's params (the weights, or AdamW's moments of them) in nanoGPT's
    layout and order: a dict from its names to float arrays (``lm_head.weight`` not included)."""
    out = {}
    for name, shape, dest, linear in nanogpt_table(cfg):
        parts = [arrays[ours].T if linear else arrays[ours] for ours, _ in dest]   # (in, out) -> (out, in)
        out[name] = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))
        if out[name].shape != shape:  # an internal invariant of the table, said plainly
            raise ShapeError(f"{name}: made {fmt_shape(out[name].shape)}, nanoGPT's is {fmt_shape(shape)}")
    return out


def from_nanogpt(state: dict, cfg, where: str) -> dict:
    """nanoGPT's ``state_dict`` (names without ``_orig_mod.``, NumPy arrays) as qkv's params of
    ``cfg``: every tensor of the table present with its shape, ``lm_head.weight`` equal to
    ``wte``, a mask buffer of (1, 1, T, T) dropped; anything else is a CheckpointError naming it."""
    table = {name: (shape, dest, linear) for name, shape, dest, linear in nanogpt_table(cfg)}
    buffers = {f"transformer.h.{i}.attn.bias" for i in range(cfg.n_layer)}
    known = set(table) | buffers | {"lm_head.weight"}
    unknown = sorted(n for n in state if n not in known)
    missing = sorted(n for n in table if n not in state)
    for what, names in (("unknown", unknown), ("missing", missing)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise CheckpointError(f"{where}: {len(names)} {what} tensor(s) for nanoGPT's GPT of its model_args "
                                  f"(bias={cfg.bias}, n_layer={cfg.n_layer}): {shown}")
    out = {}
    for name, x in state.items():
        if name in buffers:
            t = cfg.block_size
            if tuple(x.shape) != (1, 1, t, t):
                raise CheckpointError(f"{where}: buffer {name} must have shape (1, 1, {t}, {t}); "
                                      f"got {fmt_shape(x.shape)}")
            continue
        if name == "lm_head.weight":
            if not np.array_equal(x, state["transformer.wte.weight"]):
                raise CheckpointError(f"{where}: lm_head.weight differs from transformer.wte.weight; nanoGPT "
                                      f"ties them")
            continue
        shape, dest, linear = table[name]
        if tuple(x.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} must have shape {fmt_shape(shape)} (from model_args); "
                                  f"got {fmt_shape(x.shape)}")
        for ours, rows in dest:
            part = x[rows]
            out[ours] = part.T if linear else part
    return out


def param_groups(cfg) -> tuple[list[str], list[str]]:
    """nanoGPT's ``configure_optimizers`` groups by name, in ``named_parameters()`` order (the
    tied ``lm_head`` counted once, as wte): every tensor of 2 or more dimensions decays, the
    rest does not."""
    names = [name for name, shape, _, _ in nanogpt_table(cfg)]
    shapes = {name: shape for name, shape, _, _ in nanogpt_table(cfg)}
    return [n for n in names if len(shapes[n]) >= 2], [n for n in names if len(shapes[n]) < 2]
