"""Checkpoints in and out: nanoGPT's ``ckpt.pt`` to a qkv folder and back, and a qkv GPT to transformers' GPT-2.

- :func:`read_nanogpt` / :func:`nanogpt_to_folder`: a ``ckpt.pt`` nanoGPT's ``train.py`` saved
  (``torch.load(weights_only=True)``: tensors and plain data, no code run) as a :class:`GPT`
  and a folder ``qkv sample`` reads. Its vocabulary is the ``meta.pkl`` of the dataset the
  checkpoint names, looked up as nanoGPT's ``sample.py`` does (``data/<dataset>/meta.pkl``
  under the current folder), or the one given; without one the ids are GPT-2's.
- :func:`folder_to_nanogpt`: a folder ``qkv train gpt`` wrote as a ``ckpt.pt`` with nanoGPT's
  keys (``model``, ``optimizer``, ``model_args``, ``iter_num``, ``best_val_loss``, ``config``):
  ``sample.py`` samples it and ``train.py --init_from=resume`` continues it (AdamW's moments
  carried over, in nanoGPT's two parameter groups). A character vocabulary is written as
  ``meta.pkl`` beside it, for nanoGPT's ``data/<dataset>/``.
- :func:`folder_to_gpt2`: a transformers ``GPT2LMHeadModel`` folder (``config.json``,
  ``model.safetensors``, the tokenizer's files for a BPE run) that ``from_pretrained`` loads
  with the same logits. A model without biases is written with zero biases (the same
  function); the exact GELU is transformers' ``"gelu"``, the tanh form ``"gelu_new"``.

The tensor table is :mod:`qkv.io.nanogpt`'s (nanoGPT) and :func:`qkv.io.gpt_files.gpt2_table`
(GPT-2). A model the target cannot compute is a CheckpointError naming what it cannot hold.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import numpy as np

from ..extras import require
from .checkpoint import CheckpointError, gpt_sizes_match
from .nanogpt import (COMPILED, config_of, from_nanogpt, gpt2_shape_refusals, model_args, nanogpt_refusals,
                      param_groups, to_nanogpt)

HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
GPT2_EOS = 50256  # GPT-2's <|endoftext|>
MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.bias$")


def _torch():
    return require("torch", "torch")


def _array(name: str, t, where) -> np.ndarray:
    torch = _torch()
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise CheckpointError(f"{where}: {name} must be a floating tensor; got {getattr(t, 'dtype', type(t).__name__)}")
    return t.detach().to("cpu", torch.float32).numpy()


def load_ckpt(path) -> dict:
    """nanoGPT's ``ckpt.pt`` as torch loads it with ``weights_only=True`` (tensors and plain data)."""
    torch, path = _torch(), Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file (nanoGPT saves out_dir/ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle, zip and torch's own errors
        raise CheckpointError(f"cannot read {path} as nanoGPT's ckpt.pt (torch.load, weights_only): "
                              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "model_args" not in ckpt:
        raise CheckpointError(f"{path} must hold nanoGPT's checkpoint: a dict with 'model' (the state_dict) and "
                              f"'model_args'; got {type(ckpt).__name__} with keys "
                              f"{sorted(map(str, ckpt)) if isinstance(ckpt, dict) else '-'}")
    return ckpt


def read_nanogpt(path, dtype=np.float32):
    """``(model, ckpt)``: the :class:`GPT` of a nanoGPT ``ckpt.pt`` in eval mode, and the checkpoint."""
    from ..models.gpt import GPT
    from .gpt_files import _assign

    ckpt = load_ckpt(path)
    state = {}
    for name, t in ckpt["model"].items():
        name = str(name)
        name = name[len(COMPILED):] if name.startswith(COMPILED) else name   # sample.py's unwanted_prefix
        buffer = MASK_BUFFER.match(name) is not None   # nanoGPT without flash attention: its causal mask
        state[name] = t.detach().cpu().numpy() if buffer else _array(name, t, path)
    if isinstance(ckpt["model_args"], dict):  # else config_of names what model_args must be
        gpt_sizes_match(state, ckpt["model_args"], "transformer.", f"{path}: model_args")  # before any is made of them
    cfg = config_of(ckpt["model_args"], f"{path}", dtype)
    model = GPT(cfg)
    for name, x in from_nanogpt(state, cfg, str(path)).items():
        _assign(model, name, x, str(path))
    return model.eval(), ckpt


def nanogpt_vocab(ckpt: dict, vocab_size: int, meta=None, where=""):
    """``(tokenizer, said)``: the checkpoint's vocabulary (see the module docstring) and where it came from."""
    from ..training.bindata import meta_tokenizer, read_meta
    from ..training.bpe import NoTokenizer, load_bpe

    config = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    if meta is None and isinstance(config.get("dataset"), str):
        found = Path("data") / config["dataset"] / "meta.pkl"   # sample.py: os.path.join('data', dataset, 'meta.pkl')
        meta = found if found.is_file() else None
    if meta is not None:
        tok = meta_tokenizer(read_meta(meta), meta)
        if tok.vocab_size > vocab_size:
            raise CheckpointError(f"{meta} has {tok.vocab_size} characters, more than the checkpoint's vocab_size "
                                  f"{vocab_size}: it is another dataset's meta.pkl")
        return tok, f"the characters of {meta}"
    try:  # nanoGPT's sample.py: no meta.pkl means GPT-2's encoding
        return load_bpe("gpt2", download=False), "GPT-2's BPE (no meta.pkl; nanoGPT assumes GPT-2's encoding)"
    except CheckpointError:
        return NoTokenizer(vocab_size), ("no tokenizer: no meta.pkl, and GPT-2's is not cached here "
                                         "(sample with --tokenizer gpt2|DIR)")


def nanogpt_to_folder(src, dst, meta=None, *, force: bool = False) -> str:
    """Write the model of nanoGPT's ``src`` (ckpt.pt) into the folder ``dst`` (see the module
    docstring); returns where its vocabulary came from. ``dst`` must be new or empty
    (:mod:`qkv.io.targets`; ``force``: any folder, whose files of these names are replaced)."""
    from ..training.bpe import TOKENIZER_FILE, BPETokenizer
    from .runsave import save_files
    from .targets import free_folder

    free_folder(dst, force)
    model, ckpt = read_nanogpt(src)
    tok, said = nanogpt_vocab(ckpt, model.config.vocab_size, meta, src)
    plain = {k: ckpt.get(k) for k in ("model_args", "iter_num", "config")}
    best = ckpt.get("best_val_loss")
    plain["best_val_loss"] = None if best is None else float(best)
    extra = {"tokenizer": tok.to_dict(), "nanogpt": {"source": str(Path(src).resolve()), **_jsonable(plain)}}

    def write(tmp: Path) -> list:
        model.save(tmp, extra=extra)
        names = ["model.safetensors", "config.json"]
        if isinstance(tok, BPETokenizer):
            (tmp / TOKENIZER_FILE).write_text(tok.to_json())
            names.insert(0, TOKENIZER_FILE)
        return names

    Path(dst).mkdir(parents=True, exist_ok=True)
    save_files(dst, write)
    return said


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    try:
        return float(x)   # a 0-d tensor (best_val_loss) or a NumPy scalar
    except (TypeError, ValueError):
        return str(x)


def read_folder(folder):
    """``(model, extra, train_cfg, adam_state)`` of a folder qkv wrote (a run, or any saved GPT);
    ``train_cfg`` and ``adam_state`` are None where it holds no training state."""
    from .gpt_files import load_gpt
    from .runfiles import load_state
    from .runsave import finish_save, folder_lock
    from ..training.config import TrainConfig

    folder = Path(folder)
    finish_save(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} must be a folder qkv train gpt (or GPT.save) wrote; it has no config.json")
    with folder_lock(folder):
        model, extra = load_gpt(folder)
        train = extra.get("train") if isinstance(extra, dict) else None
        cfg = state = None
        if isinstance(train, dict) and (folder / "optim.safetensors").is_file():
            cfg = TrainConfig.from_dict(train["config"]).resolved()
            state = load_state(folder / "optim.safetensors")
    return model, extra, cfg, state


def _refuse(what: str, src, reasons: list[str]) -> None:
    if reasons:
        raise CheckpointError(f"{src} cannot be written as {what}: its model has {'; '.join(reasons)}")


def _optimizer(model, cfg, state, step: int) -> dict:
    """torch AdamW's ``state_dict()`` for nanoGPT's two groups (decayed: the 2-D tensors)."""
    torch = _torch()
    from ..training.loop import lr_at

    decay, no_decay = param_groups(model.config)
    order = decay + no_decay
    moments = {}
    if state is not None:
        for slot in "mv":
            arrays = {k[2:]: np.asarray(v, np.float32) for k, v in state.items() if k.startswith(f"{slot}/")}
            moments[slot] = to_nanogpt(arrays, model.config)
    t = int(np.asarray(state["step"])) if state is not None else 0
    per = {}
    if t > 0:
        per = {i: {"step": torch.tensor(float(t)), "exp_avg": torch.from_numpy(moments["m"][n]),
                   "exp_avg_sq": torch.from_numpy(moments["v"][n])} for i, n in enumerate(order)}
    lr = lr_at(step, cfg) if cfg is not None else 1e-3
    betas = (cfg.beta1, cfg.beta2) if cfg is not None else (0.9, 0.99)
    wd = cfg.weight_decay if cfg is not None else 0.1
    common = {"lr": lr, "betas": betas, "eps": 1e-8, "amsgrad": False, "foreach": None, "maximize": False,
              "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    return {"state": per, "param_groups": [
        {**common, "weight_decay": wd, "params": list(range(len(decay)))},
        {**common, "weight_decay": 0.0, "params": list(range(len(decay), len(order)))}]}


def folder_to_nanogpt(src, dst, dataset: str | None = None, *, force: bool = False) -> list[str]:
    """Write the qkv folder ``src`` as nanoGPT's ``dst`` (``ckpt.pt``), and a character vocabulary
    as ``meta.pkl`` beside it; returns the notes to show. Neither replaces a file that is there
    already (a ``meta.pkl`` of the same bytes aside) unless ``force``; both are written whole."""
    torch = _torch()
    from .targets import free_file, write_atomic
    from ..training.config import TrainConfig
    from .nanoconfig import nanogpt_config
    from ..training.loop import best_val

    model, extra, cfg, state = read_folder(src)
    _refuse("nanoGPT's ckpt.pt", src, nanogpt_refusals(model.config))
    params = {k: np.asarray(v, np.float32) for k, v in model.params.items()}
    weights = {k: torch.from_numpy(v) for k, v in to_nanogpt(params, model.config).items()}
    weights["lm_head.weight"] = weights["transformer.wte.weight"]   # tied, as nanoGPT's state_dict has it
    train = extra.get("train", {}) if isinstance(extra, dict) else {}
    step = int(train.get("step", 0)) if state is not None else 0
    data = train.get("data", {}) if isinstance(train, dict) else {}
    source = str(data.get("source", "qkv"))
    if dataset is None:
        dataset = Path(source).name if data.get("kind") == "bin" else Path(source).stem or "qkv"
    log_best = best_val(_read_log(Path(src))) if state is not None else None
    ckpt = {"model": weights, "optimizer": _optimizer(model, cfg, state, step),
            "model_args": model_args(model.config), "iter_num": step,
            "best_val_loss": float(log_best) if log_best is not None else 1e9,
            "config": nanogpt_config(cfg or TrainConfig(), dataset=dataset, out_dir=str(Path(dst).parent))}
    dst = Path(dst)
    tok = extra.get("tokenizer", {}) if isinstance(extra, dict) else {}
    meta = None
    if tok.get("kind") == "char":
        chars = tok["chars"]
        meta = pickle.dumps({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                             "stoi": {c: i for i, c in enumerate(chars)}})
        free_file(dst.parent / "meta.pkl", force, same=meta)   # both refused before either is written
    free_file(dst, force)
    part = dst.with_name(dst.name + ".part")
    torch.save(ckpt, part)
    os.replace(part, dst)   # the old ckpt.pt or the new one, never half of one
    notes = [f"wrote {dst} (iter_num {step}; nanoGPT: python sample.py --out_dir={dst.parent}, "
             f"or train.py --init_from=resume --out_dir={dst.parent})"]
    if meta is not None:
        write_atomic(dst.parent / "meta.pkl", meta)
        notes.append(f"wrote {dst.parent / 'meta.pkl'} (the characters): nanoGPT's sample.py reads it from "
                     f"data/{dataset}/meta.pkl, so copy it there (config['dataset'] = {dataset!r})")
    return notes


def _read_log(folder: Path) -> dict:
    from .checkpoint import read_json

    return read_json(folder / "log.json") if (folder / "log.json").is_file() else {"evals": []}


def gpt2_refusals(cfg) -> list[str]:
    """What of ``cfg`` transformers' GPT-2 cannot compute; empty when it can."""
    out = gpt2_shape_refusals(cfg, "GPT-2")
    if cfg.activation not in HF_ACTIVATIONS:
        out.append(f"activation {cfg.activation!r} (GPT-2's MLP has one projection in, one out: no SwiGLU)")
    return out


def _gpt2_tokenizer(tok: dict, src: Path, block_size: int) -> dict:
    """The tokenizer files of a GPT-2 folder for the run's tokenizer ``tok``: a BPE run's own
    ``tokenizer.json``; a character run's vocabulary as one (``char_tokenizer_json``) with a
    ``tokenizer_config.json`` that makes transformers read it as it is; else none."""
    from ..training.bpe import TOKENIZER_FILE, char_tokenizer_json

    if tok.get("kind") == "bpe" and (src / TOKENIZER_FILE).is_file():
        return {TOKENIZER_FILE: (src / TOKENIZER_FILE).read_text(encoding="utf-8")}
    if tok.get("kind") == "char" and isinstance(tok.get("chars"), str):
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                  "clean_up_tokenization_spaces": False}
        return {TOKENIZER_FILE: char_tokenizer_json(tok["chars"]),
                "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
    return {}


def folder_to_gpt2(src, dst, *, force: bool = False) -> list[str]:
    """Write the qkv folder ``src`` as a transformers GPT-2 folder ``dst``; returns the notes to show.
    ``dst`` must be new or empty (``force``: any folder, whose files of these names are replaced);
    a new folder appears whole or not at all (:func:`qkv.io.targets.publish_folder`)."""
    from ..training.bpe import TOKENIZER_FILE
    from .gpt_files import gpt2_table
    from .targets import free_folder, publish_folder
    from .tensorfiles import write_tensors

    free_folder(dst, force)
    model, extra, _, _ = read_folder(src)
    c = model.config
    _refuse("transformers' GPT-2", src, gpt2_refusals(c))
    tensors = {}
    for name, shape, dest in gpt2_table(c):
        parts = [np.asarray(model.params[ours], np.float32) if ours in model.params
                 else np.zeros(shape[-1] // len(dest), np.float32) for ours, _ in dest]   # a bias the model has not: zeros, the same function
        tensors[name] = np.ascontiguousarray(np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
    gpt2_vocab = c.vocab_size >= GPT2_EOS + 1
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
              "n_positions": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
              "n_inner": c.n_inner, "activation_function": HF_ACTIVATIONS[c.activation],
              "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
              "layer_norm_epsilon": c.layer_norm_eps, "initializer_range": 0.02, "scale_attn_weights": True,
              "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "use_cache": True,
              "tie_word_embeddings": c.tie_weights, "bos_token_id": GPT2_EOS if gpt2_vocab else None,
              "eos_token_id": GPT2_EOS if gpt2_vocab else None, "dtype": "float32"}
    dst = Path(dst)
    tok = extra.get("tokenizer", {}) if isinstance(extra, dict) else {}
    files = _gpt2_tokenizer(tok, Path(src), c.block_size)

    def write(folder: Path) -> None:
        write_tensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in files.items():
            (folder / name).write_text(text)

    ours = {"model.safetensors", "config.json", *files}
    theirs = sorted(p.name for p in dst.iterdir() if p.name not in ours) if dst.is_dir() else []
    publish_folder(dst, write)
    notes = [f"wrote {dst / 'model.safetensors'}, {dst / 'config.json'} (transformers: "
             f"GPT2LMHeadModel.from_pretrained({str(dst)!r}))"]
    if theirs:
        notes.append(f"note: left as they were in {dst} (not this model's; --force replaces only what it writes): "
                     f"{', '.join(theirs[:5])}{' ...' if len(theirs) > 5 else ''}")
    if tok.get("kind") == "bpe" and files:
        notes.append(f"wrote {dst / TOKENIZER_FILE} (the run's tokenizer)")
    elif tok.get("kind") == "char":
        notes.append(f"wrote {dst / TOKENIZER_FILE} and {dst / 'tokenizer_config.json'} (the run's characters, one "
                     f"token each: AutoTokenizer.from_pretrained({str(dst)!r}), and qkv sample {dst})")
    return notes
