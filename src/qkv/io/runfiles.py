"""A training run on disk: what ``qkv train gpt --out DIR`` writes and ``--resume`` reads.

``DIR`` holds::

    model.safetensors   the GPT's parameters                      (GPT.save)
    config.json         the GPT's config, and under its extra:    (GPT.save(extra=...))
                          tokenizer  {"kind": "char", "chars": the vocabulary}, or
                                     {"kind": "bpe", ...}, {"kind": "none", ...} (qkv.training.bpe)
                          train      the TrainConfig, the step, the seconds so far, the data's
                                     source and SHA-256, the bit_generator.state of the data
                                     Generator and of the model's (its dropout masks)
    optim.safetensors   AdamW's state_dict(): its arrays as tensors, the rest (step count,
                        hyper-parameters) as JSON in the file's metadata
    log.json            {"evals": [{"step", "train_loss", "val_loss", "lr", "seconds"}, ...],
                         "losses": [every step's batch loss]}
    tokenizer.json      a BPE tokenizer's file (runs with one only)

A save is atomic as a whole (:mod:`qkv.io.runsave`): the files are written into
``DIR/.saving``, committed by one rename, then moved into place; a process killed at any
point leaves the previous checkpoint or the new one, which the next ``--resume`` (or ``qkv
sample``, or save) completes. Needs the ``models`` extra (safetensors).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..errors import ShapeError
from ..extras import require
from ..training.bpe import TOKENIZER_FILE, BPETokenizer, tokenizer_from_dict
from .checkpoint import CheckpointError, read_json
from .runsave import finish_save, folder_lock, save_files
from .tensorfiles import write_tensors
from ..training.loop import Run, TrainConfig, make_optimizer

FILES = ("model.safetensors", "config.json", "optim.safetensors", "log.json")


def _flatten(obj, name: str, arrays: dict):
    """``obj`` as JSON with every NumPy array (and NumPy scalar) replaced by a reference into ``arrays``."""
    if isinstance(obj, (np.ndarray, np.generic)):
        arrays[name] = np.array(obj, order="C")  # a copy; 0-d stays 0-d (ascontiguousarray would make it 1-d)
        return {"__array__": name, "scalar": isinstance(obj, np.generic)}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise ShapeError(f"optimizer state {name!r}: dict keys must be strings to be saved")
        return {"__dict__": {k: _flatten(v, f"{name}.{k}", arrays) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{name}.{i}", arrays) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ShapeError(f"optimizer state {name!r}: cannot save a {type(obj).__name__}")


def _unflatten(skeleton, arrays: dict):
    if isinstance(skeleton, dict) and "__array__" in skeleton:
        a = arrays[skeleton["__array__"]]
        return a[()] if skeleton["scalar"] else a
    if isinstance(skeleton, dict) and "__dict__" in skeleton:
        return {k: _unflatten(v, arrays) for k, v in skeleton["__dict__"].items()}
    if isinstance(skeleton, dict) and "__list__" in skeleton:
        items = [_unflatten(v, arrays) for v in skeleton["__list__"]]
        return tuple(items) if skeleton["tuple"] else items
    return skeleton


def save_state(state, path) -> None:
    """Any nest of dicts, lists, arrays and JSON scalars (an optimizer's ``state_dict()``) to safetensors."""
    arrays = {}
    skeleton = _flatten(state, "state", arrays)
    write_tensors(arrays, path, metadata={"qkv_state": json.dumps(skeleton)})


def load_state(path):
    """What :func:`save_state` wrote, arrays and NumPy scalars with their dtypes; a file that is
    not one (truncated, damaged, another kind) is a CheckpointError naming it."""
    st = require("safetensors", "models")
    require("safetensors.numpy", "models")
    try:
        with st.safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        skeleton = json.loads(meta["qkv_state"]) if "qkv_state" in meta else None
    except Exception as err:  # safetensors raises its own error types; json a ValueError
        raise CheckpointError(f"cannot read {path} (damaged or truncated?): {type(err).__name__}: {err}") from None
    if skeleton is None:
        raise CheckpointError(f"{path} was not written by qkv's save_state (no qkv_state metadata)")
    try:
        return _unflatten(skeleton, arrays)
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: its qkv_state metadata does not match its tensors ({err!r})") from None


def save_run(run: Run, folder) -> None:
    """Write the run's files into ``folder``, atomically as a whole (:mod:`qkv.io.runsave`):
    a kill at any point leaves the previous checkpoint or this one."""
    extra = {"tokenizer": run.tokenizer.to_dict(),
             "train": {"config": asdict(run.cfg), "step": run.step, "seconds": run.seconds, "data": run.data,
                       "rng": run.rng.bit_generator.state, "model_rng": run.model.rng.bit_generator.state}}

    def write(tmp: Path) -> list:
        run.model.save(tmp, extra=extra)
        save_state(run.opt.state_dict(), tmp / "optim.safetensors")
        (tmp / "log.json").write_text(json.dumps(run.log))
        names = ["optim.safetensors", "log.json", "model.safetensors", "config.json"]
        if isinstance(run.tokenizer, BPETokenizer):
            (tmp / TOKENIZER_FILE).write_text(run.tokenizer.to_json())
            names.insert(0, TOKENIZER_FILE)
        return names

    save_files(folder, write)


def _restore(rng: np.random.Generator, state, what: str, where) -> None:
    kind = type(rng.bit_generator).__name__
    saved = state.get("bit_generator") if isinstance(state, dict) else None
    if saved != kind:
        raise CheckpointError(f"{where}: the saved {what} must be a {kind} Generator's state; got {saved!r}")
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as err:  # -5 as a uint64: OverflowError
        raise CheckpointError(f"{where}: the saved {what}'s state is damaged: {type(err).__name__}: {err}") from None


def _check_moments(state, path) -> None:
    """AdamW's moments as the model's weights are checked: finite, and the second moments (running
    means of squares) >= 0; a NaN there would make every weight NaN at the next update."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} must hold an optimizer's state (a dict); got {type(state).__name__}")
    for name, a in state.items():
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            if not np.isfinite(a).all():
                raise CheckpointError(f"{path}: tensor {name} holds non-finite values (NaN or inf)")
            if name.startswith("v/") and (a < 0).any():
                raise CheckpointError(f"{path}: tensor {name} (a mean of squares) holds negative values")


def load_run(folder) -> Run:
    """The run saved in ``folder``, ready for :func:`qkv.training.loop.train` to continue.

    Every file is checked against the others before anything is trusted: a damaged or
    truncated file, a config.json whose model (dtype included) is not the one its training
    config makes, non-finite weights or optimizer moments, or files from different saves are a
    CheckpointError naming the file. A save that was killed is completed (or discarded) first
    (:func:`qkv.io.runsave.finish_save`)."""
    folder = Path(folder)
    finish_save(folder)
    with folder_lock(folder):  # a save that starts meanwhile waits until every file is read
        return _load_run(folder)


def _load_run(folder: Path) -> Run:
    from .gpt_files import load_gpt
    from ..training.loop import gpt_config

    missing = [n for n in FILES if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a complete training run: {', '.join(missing)} missing")
    model, extra = load_gpt(folder)
    where = folder / "config.json"
    if not isinstance(extra, dict) or not isinstance(extra.get("train"), dict):
        raise CheckpointError(f"{folder} holds a GPT but not a run of qkv train gpt (its config has no training state)")
    train = extra["train"]
    try:
        cfg = TrainConfig.from_dict(train["config"]).resolved()
        tokenizer = tokenizer_from_dict(extra.get("tokenizer"), folder)
        step, seconds, data = int(train["step"]), float(train["seconds"]), dict(train["data"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: bad training state under extra.train: {err}") from None
    made = gpt_config(cfg, tokenizer.vocab_size)
    differ = [f"{k} {v!r} (the training config makes {made.to_dict()[k]!r})"
              for k, v in model.config.to_dict().items() if v != made.to_dict()[k]]
    if differ:
        raise CheckpointError(f"{where}: the model's config disagrees with the run's training config: "
                              f"{', '.join(differ)}; was config.json edited?")
    opt = make_optimizer(model, cfg)
    state = load_state(folder / "optim.safetensors")
    _check_moments(state, folder / "optim.safetensors")
    try:
        opt.load_state_dict(state)
    except ShapeError as err:
        raise CheckpointError(f"{folder / 'optim.safetensors'}: {err}") from None
    rng = np.random.default_rng()
    _restore(rng, train.get("rng"), "data stream", where)
    _restore(model.rng, train.get("model_rng"), "model's Generator", where)  # in place: the dropout layers share it
    log = read_json(folder / "log.json")
    if not (isinstance(log.get("losses"), list) and isinstance(log.get("evals"), list)):
        raise CheckpointError(f"{folder / 'log.json'} must hold {{\"evals\": [...], \"losses\": [...]}}; "
                              f"got the keys {sorted(log)}")
    for what, n in (("log.json has", len(log["losses"])), ("optim.safetensors is at", opt.t)):
        if n != step:
            raise CheckpointError(f"{folder}: {what} {n} steps, config.json {step}: the files come from "
                                  f"different saves")
    return Run(cfg, model, opt, rng, tokenizer, data, step=step, seconds=seconds, log=log)
