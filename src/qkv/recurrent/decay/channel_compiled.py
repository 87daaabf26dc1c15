"""numba passes of the decay kernel's backward with a decay a key channel (GLA, RWKV-6); load it
through ``qkv.jit.load(qkv.jit.DECAY_CHANNELS)`` only. (Being built: issue 63.)"""
from __future__ import annotations

import numba  # noqa: F401  (the passes being built here are numba code)
