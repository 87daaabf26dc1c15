"""numba passes of the generalized delta rule (dplr: RWKV-7); load it through
``qkv.jit.load(qkv.jit.DPLR)`` only. (Being built: issue 63.)"""
from __future__ import annotations

import numba  # noqa: F401  (the passes being built here are numba code)
