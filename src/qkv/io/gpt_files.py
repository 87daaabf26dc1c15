"""GPT files: qkv's own (written by ``GPT.save``, read by :func:`load_gpt`) and Hugging Face GPT-2 (:func:`load_gpt2`).

A saved qkv GPT is a folder with ``model.safetensors`` (every array of ``GPT.params`` under
its name, the tied head stored once) and ``config.json``::

    {"format": "qkv-gpt", "config": {GPTConfig's fields}, "extra": {whatever the caller saved}}

A Hugging Face GPT-2 folder (``config.json`` with ``model_type: "gpt2"`` and
``model.safetensors``) goes through one explicit table, :func:`gpt2_table`: each checkpoint
tensor, its shape from config.json, and where it goes. GPT-2 projects with ``Conv1D``,
which stores its weight as ``(in, out)`` and computes ``x @ W + b``, qkv's own layout, so no
tensor is transposed; the fused ``c_attn`` ``(C, 3C)`` is cut into ``W_Q``, ``W_K``, ``W_V``
by columns (and its bias likewise). The causal-mask buffers some files carry
(``attn.bias``, ``attn.masked_bias``) are checked for shape and dropped. A tensor the table
does not know, one it needs that is missing, one of another shape, a non-finite value or a
config that is not GPT-2's architecture is a :class:`CheckpointError` naming it.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ShapeError, fmt_shape
from .checkpoint import CheckpointError, gpt_sizes_match, read_json
from ..models.gpt import GPT, SAVED_FORMAT, GPTConfig

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                    "gelu": "gelu"}
# config.json fields that would change GPT-2's computation, and the value qkv computes with.
GPT2_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


def _safetensors():
    from ..extras import require

    return require("safetensors.numpy", "models")


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return _safetensors().load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {path}: {err}") from None


def _assign(model: GPT, name: str, x: np.ndarray, where: str) -> None:
    """``model.params[name][...] = x`` after the dtype and finiteness checks."""
    if x.dtype.kind != "f":
        raise CheckpointError(f"{where}: tensor {name} must be floating; got {x.dtype}")
    with np.errstate(over="ignore"):
        x = x.astype(model.dtype, copy=False)
    if not np.isfinite(x).all():
        raise CheckpointError(f"{where}: tensor {name} holds non-finite values (NaN or inf in {model.dtype})")
    model.params[name][...] = x


def load_gpt(directory) -> tuple[GPT, dict]:
    """A model written by ``GPT.save``, and the ``extra`` dict saved with it."""
    folder = Path(directory)
    where = folder / "config.json"
    meta = read_json(where)
    if meta.get("format") != SAVED_FORMAT or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{where} must hold a qkv GPT's config (format {SAVED_FORMAT!r}, as GPT.save writes); "
                              f"got format {meta.get('format')!r}")
    path = folder / "model.safetensors"
    raw = _read_tensors(path)
    gpt_sizes_match(raw, meta["config"], "transformer.", path)  # before a config, or GPT(config), is made of them
    try:
        config = GPTConfig(**meta["config"])
    except (TypeError, ValueError, OverflowError) as err:   # ShapeError is a ValueError
        raise CheckpointError(f"{where}: bad config: {err}") from None
    extra = meta.get("extra", {})
    model = GPT(config)
    unknown, missing = sorted(set(raw) - set(model.params)), sorted(set(model.params) - set(raw))
    if unknown or missing:
        raise CheckpointError(f"{path}: the tensors do not match the config's model: missing {missing[:5]}, "
                              f"unknown {unknown[:5]}")
    for name, want in model.params.items():
        if raw[name].shape != want.shape:
            raise CheckpointError(f"{path}: tensor {name} must have shape {fmt_shape(want.shape)}; "
                                  f"got {fmt_shape(raw[name].shape)}")
        _assign(model, name, raw[name], str(path))
    return model, extra


# --- Hugging Face GPT-2 --------------------------------------------------------------------
def _field(raw: dict, name: str, where: str, default=None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {name} must be a positive int; got {value!r}")
    return value


def gpt2_config(raw: dict, where: str, dtype) -> GPTConfig:
    """The :class:`GPTConfig` of a GPT-2 ``config.json``; anything else is a CheckpointError."""
    if raw.get("model_type") != "gpt2":
        raise CheckpointError(f"{where}: model_type must be 'gpt2' (load_gpt2 reads GPT-2 checkpoints); "
                              f"got {raw.get('model_type')!r}")
    act = raw.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"{where}: activation_function must be one of {sorted(GPT2_ACTIVATIONS)}; got {act!r}")
    for name, value in GPT2_FIXED.items():
        if raw.get(name, value) != value:
            raise CheckpointError(f"{where}: {name} must be {value} (GPT-2's architecture, which qkv computes); "
                                  f"got {raw.get(name)!r}")
    eps = raw.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise CheckpointError(f"{where}: layer_norm_epsilon must be a number in (0, 1); got {eps!r}")
    tie = raw.get("tie_word_embeddings", True)
    n_inner = raw.get("n_inner")
    fields = {k: _field(raw, k, where) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    try:
        return GPTConfig(vocab_size=fields["vocab_size"], block_size=fields["n_positions"],
                         n_layer=fields["n_layer"], n_head=fields["n_head"], n_embd=fields["n_embd"],
                         n_inner=None if n_inner is None else _field(raw, "n_inner", where),
                         activation=GPT2_ACTIVATIONS[act], tie_weights=bool(tie), layer_norm_eps=float(eps),
                         dtype=dtype)
    except ShapeError as err:
        raise CheckpointError(f"{where}: {err}") from None


def gpt2_table(cfg: GPTConfig) -> list[tuple[str, tuple, list[tuple[str, slice]]]]:
    """Every GPT-2 tensor: ``(checkpoint name, its shape, [(our name, columns), ...])``; an empty
    list marks a buffer that is checked and dropped."""
    c, f, p, every = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd, cfg.block_size, slice(None)
    rows = [("wte.weight", (cfg.vocab_size, c), [("transformer.wte.weight", every)]),
            ("wpe.weight", (p, c), [("transformer.wpe.weight", every)])]
    for i in range(cfg.n_layer):
        hf, us = f"h.{i}.", f"transformer.h.{i}."
        qkv_w = [(f"{us}attn.W_{n}", slice(j * c, (j + 1) * c)) for j, n in enumerate("QKV")]
        qkv_b = [(f"{us}attn.b_{n}", slice(j * c, (j + 1) * c)) for j, n in enumerate("QKV")]
        rows += [(f"{hf}ln_1.weight", (c,), [(f"{us}ln_1.weight", every)]),
                 (f"{hf}ln_1.bias", (c,), [(f"{us}ln_1.bias", every)]),
                 (f"{hf}attn.c_attn.weight", (c, 3 * c), qkv_w),
                 (f"{hf}attn.c_attn.bias", (3 * c,), qkv_b),
                 (f"{hf}attn.c_proj.weight", (c, c), [(f"{us}attn.W_O", every)]),
                 (f"{hf}attn.c_proj.bias", (c,), [(f"{us}attn.b_O", every)]),
                 (f"{hf}ln_2.weight", (c,), [(f"{us}ln_2.weight", every)]),
                 (f"{hf}ln_2.bias", (c,), [(f"{us}ln_2.bias", every)]),
                 (f"{hf}mlp.c_fc.weight", (c, f), [(f"{us}mlp.W_fc", every)]),
                 (f"{hf}mlp.c_fc.bias", (f,), [(f"{us}mlp.b_fc", every)]),
                 (f"{hf}mlp.c_proj.weight", (f, c), [(f"{us}mlp.W_proj", every)]),
                 (f"{hf}mlp.c_proj.bias", (c,), [(f"{us}mlp.b_proj", every)])]
    rows += [("ln_f.weight", (c,), [("transformer.ln_f.weight", every)]),
             ("ln_f.bias", (c,), [("transformer.ln_f.bias", every)])]
    if not cfg.tie_weights:
        rows.append(("lm_head.weight", (cfg.vocab_size, c), [("lm_head.weight", every)]))
    return rows


def gpt2_folder(path_or_hub_id) -> Path:
    """The folder of a GPT-2 named by a path, or by a hub id (the local cache first, a download where
    allowed); a CheckpointError naming what was looked for otherwise."""
    from .locate import HUB_ID, from_hub

    if not isinstance(path_or_hub_id, (str, os.PathLike)):
        raise ShapeError(f"the model must be a folder path or a Hugging Face model id; "
                         f"got {type(path_or_hub_id).__name__}")
    folder = Path(path_or_hub_id).expanduser()
    if not folder.exists() and isinstance(path_or_hub_id, str) and HUB_ID.match(path_or_hub_id):
        folder = from_hub(path_or_hub_id)
    if not folder.is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a folder (a GPT-2 folder has config.json and model.safetensors)")
    return folder


def load_gpt2(path_or_hub_id, *, dtype=np.float32) -> GPT:
    """A Hugging Face GPT-2 (a folder, or a hub id: the local cache first) as a :class:`GPT`.

    Logits equal ``transformers.GPT2LMHeadModel``'s on the same weights (float32 to 1e-4).
    The model comes in eval mode (``model.train()`` to fine-tune it), in ``dtype``.
    Raises :class:`CheckpointError` for a config that is not GPT-2's architecture, a
    missing, unknown or misshapen tensor (see :func:`gpt2_table`) or a non-finite value.
    """
    folder = gpt2_folder(path_or_hub_id)
    meta = read_json(folder / "config.json")
    path = folder / "model.safetensors"
    raw = _read_tensors(path)
    prefix = "transformer." if any(n.startswith("transformer.") for n in raw) else ""
    claimed = {"vocab_size": meta.get("vocab_size"), "block_size": meta.get("n_positions"),
               "n_embd": meta.get("n_embd"), "n_layer": meta.get("n_layer")}
    gpt_sizes_match(raw, claimed, prefix, path)  # before a config, a table of n_layer rows or GPT(cfg) is made
    cfg = gpt2_config(meta, str(folder / "config.json"), dtype)
    table = {prefix + name: (shape, dest) for name, shape, dest in gpt2_table(cfg)}
    if cfg.tie_weights and "lm_head.weight" in raw:  # a tied head stored anyway: must be wte
        table["lm_head.weight"] = ((cfg.vocab_size, cfg.n_embd), [])
    buffers = {f"{prefix}h.{i}.attn.{b}" for i in range(cfg.n_layer) for b in ("bias", "masked_bias")}
    unknown = sorted(n for n in raw if n not in table and n not in buffers)
    missing = sorted(n for n in table if n not in raw and n != "lm_head.weight")
    for what, names in (("unknown", unknown), ("missing", missing)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise CheckpointError(f"{path}: {len(names)} {what} tensor(s) for GPT-2 with this config.json: {shown}")
    model = GPT(cfg)
    for name, x in raw.items():
        if name in buffers:
            p = cfg.block_size
            if name.endswith(".bias") and x.shape not in ((1, 1, p, p),):
                raise CheckpointError(f"{path}: buffer {name} must have shape (1, 1, {p}, {p}); "
                                      f"got {fmt_shape(x.shape)}")
            continue
        shape, dest = table[name]
        if tuple(x.shape) != shape:
            raise CheckpointError(f"{path}: tensor {name} must have shape {fmt_shape(shape)} (from config.json); "
                                  f"got {fmt_shape(x.shape)}")
        if name == "lm_head.weight" and not dest and not np.array_equal(x, raw[prefix + "wte.weight"]):
            raise CheckpointError(f"{path}: lm_head.weight differs from wte.weight, but config.json ties them")
        for ours, cols in dest:
            _assign(model, ours, x[..., cols], str(path))
    return model.eval()
