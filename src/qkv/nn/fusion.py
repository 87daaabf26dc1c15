"""Where the layers' fused elementwise passes come from: :mod:`qkv.nn.fused` (numba), or nowhere.

The ``fast`` extra (numba) turns a LayerNorm, a GELU, the softmax + cross-entropy or AdamW's
update, which NumPy runs as several passes over memory with a temporary each, into one
compiled loop. :func:`compiled` gives that module where numba is installed and ``QKV_JIT=0``
is not set (looked for once, at the first call, never on ``import qkv``), and only for
arrays it can take (C-contiguous float32 or float64); otherwise None and the caller runs
its NumPy passes, which compute the same formulas.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from .. import jit

MODULE = "qkv.nn.fused"


def enabled() -> bool:
    """numba is installed and ``QKV_JIT=0`` is not set."""
    return jit.enabled()


def module() -> ModuleType | None:
    """:mod:`qkv.nn.fused`, imported at the first call, or None (no numba, or ``QKV_JIT=0``)."""
    return jit.load(MODULE)


def compiled(*arrays: np.ndarray) -> ModuleType | None:
    """The fused module if every array is a C-contiguous float32/float64 array of one dtype, else None."""
    mod = module()
    if mod is None:
        return None
    dtype = arrays[0].dtype
    for a in arrays:
        if a.dtype != dtype or dtype not in (np.float32, np.float64) or not a.flags.c_contiguous:
            return None
    return mod
