"""The optional compiled passes (the ``fast`` extra): numba, looked for once, never on ``import qkv``.

:func:`compiled` is the module :mod:`qkv.compiled` (numba kernels, compiled once per machine
into numba's on-disk cache: the tiles' exponential, the decoding rows'
products, the encoder's GELU and LayerNorm), or None where numba is not installed or ``QKV_JIT=0`` is set in
the environment; callers then keep their NumPy path.
"""
from __future__ import annotations

import importlib
import os
import threading

_lock = threading.Lock()
_loaded: list = []


def compiled():
    """:mod:`qkv.compiled`, or None (numba not installed, or ``QKV_JIT=0``)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            mod = None
            if os.environ.get("QKV_JIT", "1") != "0" and importlib.util.find_spec("numba") is not None:
                mod = importlib.import_module("qkv.compiled")
            _loaded.append(mod)
    return _loaded[0]
