"""Collective checks: every rank checks its own inputs, then all ranks agree before the ring.

A ring step waits on its neighbour, so one rank that raises alone leaves the others
waiting for a message that never comes. Here each rank runs its checks, the ranks swap
(error message, shapes and options), and if any rank failed or the ranks disagree, every
rank raises the same :class:`~qkv.ShapeError`. Only then does the first ring step start.
"""
from __future__ import annotations

import numpy as np

from ..errors import OptionError, ShapeError, fmt_shape


def _plain(value):
    """Options as plain comparable Python values (arrays as lists)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def agree(comm, what: str, check, signature: dict):
    """Run ``check()`` on every rank; return its result, or raise the same ShapeError on all.

    ``signature`` holds what must be equal on every rank (local shapes, dtypes, options).
    """
    result, message, option = None, None, False
    try:
        result = check()
    except ShapeError as err:
        message, option = str(err), isinstance(err, OptionError)
    except Exception as err:  # anything else would leave the other ranks waiting: share it too
        message = f"{type(err).__name__}: {err}"
    sig = {k: _plain(v) for k, v in signature.items()}
    seen = comm.allgather((message, option, sig))
    for rank, (msg, opt, _) in enumerate(seen):
        if msg is not None:
            raise (OptionError if opt else ShapeError)(f"{what} (rank {rank} of {len(seen)}): {msg}")
    for key in sig:
        values = [s[key] for _, _, s in seen]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(values))
            raise OptionError(f"{what}: every rank must pass the same {key}; got {listing}")
    return result


def _show(value) -> str:
    if isinstance(value, tuple) and value and value[0] == "array":
        return f"array {fmt_shape(value[2])} {value[3]}"
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return fmt_shape(value)
    return repr(value)
