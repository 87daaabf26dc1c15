"""nanoGPT's spelling on ``qkv train gpt``: ``CONFIG.py`` files and ``--name=value`` overrides.

``qkv train gpt config/train_shakespeare_char.py --max_iters=600`` reads the file as data
(:mod:`qkv.io.nanoconfig`: plain assignments, nothing run), then the overrides in order,
and maps each setting to the flag of the table in docs/gpt.md. A qkv flag given beside a
nanoGPT setting of the same meaning must agree with it. A config file is nanoGPT's run: its
model computes the exact GELU and its AdamW decays the embeddings too, so those are
``--activation gelu --decay-embeddings`` unless the flags say otherwise.
"""
from __future__ import annotations

import re

from .common import UsageError

OVERRIDE = re.compile(r"^--([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv without them, the overrides)``: ``--name=value`` tokens whose name is nanoGPT's
    (one of its settings, or any name with an underscore: an unknown one is refused by name)."""
    from ..io.nanoconfig import IGNORED, SETTINGS

    rest, overrides = [], []
    for tok in argv:
        m = OVERRIDE.match(tok)
        if m and (m.group(1) in SETTINGS or m.group(1) in IGNORED or "_" in m.group(1)):
            overrides.append(tok)
        else:
            rest.append(tok)
    return rest, overrides


def apply(args, flags: dict) -> list[str]:
    """Fold ``args.config`` (files) and ``args.nanogpt`` (overrides) into ``args``; returns the
    notes to print. ``flags``: TrainConfig field -> its flag, for the messages."""
    from ..errors import ShapeError
    from ..io.nanoconfig import map_settings, read_config_file, read_override
    from ..training.config import TrainConfig

    files, overrides = list(getattr(args, "config", None) or []), list(getattr(args, "nanogpt", None) or [])
    if not files and not overrides:
        return []
    try:
        items = [item for path in files for item in read_config_file(path)]
        items += [read_override(tok) for tok in overrides]
        fields, command, notes = map_settings(items)
    except ShapeError as err:
        raise UsageError(str(err)) from None
    said = {name: where for name, _, where in items}
    if files:  # nanoGPT's model and optimizer, unless a flag or setting says otherwise
        fields.setdefault("activation", "gelu")
        fields.setdefault("decay_embeddings", True)
    if command.pop("decay_lr", True) is False:  # nanoGPT: lr = learning_rate throughout, no warm-up
        lr = fields.get("lr", args.lr if args.lr is not None else TrainConfig().lr)
        fields.update(warmup=0, min_lr=lr)
    for name, value in fields.items():
        _merge(args, name, value, flags.get(name, name), said)
    for name, value in command.items():
        flag = {"out": "--out", "data": "--data", "resume": "--resume", "init_from": "--init-from",
                "log_interval": "--log-interval", "eval_only": "--eval-only"}[name]
        _merge(args, name, value, flag, said)
    return notes


def _merge(args, name: str, value, flag: str, said: dict) -> None:
    given = getattr(args, name, None)
    unset = given is None or (given is False and name in ("resume", "eval_only"))  # store_true flags: False is unset
    if not unset and given != value:
        raise UsageError(f"{flag} {given} disagrees with the nanoGPT setting {value!r} "
                         f"({_where(name, said)}); give one of them")
    setattr(args, name, value)


def _where(name: str, said: dict) -> str:
    from ..io.nanoconfig import SETTINGS

    for nano, (target, _) in SETTINGS.items():
        if target.split(":")[-1] == name and nano in said:
            return f"{said[nano]}: {nano}"
    return "a nanoGPT setting"
