"""The optional compiled passes (the ``fast`` extra): numba, looked for once, never on ``import qkv``.

Each part keeps its numba code beside it, in a module that imports numba and is loaded only
from here: :func:`flash` gives :mod:`qkv.kernels.flash.compiled` (the score tiles'
exponential, the decoding rows' products), :func:`encoder` gives :mod:`qkv.models.compiled`
(the encoder's bias + GELU and residual + LayerNorm); :data:`ROWS` names
:mod:`qkv.kernels.rows.compiled` (short sequences' attention, a query row a pass) and
:data:`ROWS_FUSED` :mod:`qkv.kernels.rows.fused` (those passes and the products, a call's every head in one
parallel loop). Every pass there is a module-level
``njit`` with ``cache=True``: compiled once per machine into qkv's kernel cache (a user
cache folder keyed by qkv's version, the CPU and the kernels' source; see
:mod:`qkv.jit_cache`), loaded from it by later processes; a compile says so on stderr. Both give None
where numba is not installed or ``QKV_JIT=0`` is set in the environment; callers then keep
their NumPy path.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from types import ModuleType

FLASH = "qkv.kernels.flash.compiled"
ENCODER = "qkv.models.compiled"
ROWS = "qkv.kernels.rows.compiled"
DECAY = "qkv.recurrent.decay.compiled"  # the decay kernel's scan of the states between chunks
DELTA = "qkv.recurrent.delta.compiled"  # the delta rule's (I + A)⁻¹ by forward substitution
ROWS_FUSED = "qkv.kernels.rows.fused"   # the row kernel's whole call, one parallel loop over heads
ROPE = "qkv.kernels.rope_compiled"      # rotary position embedding in one pass
SCAN = "qkv.recurrent.scan.compiled"      # Griffin's diagonal recurrence, forward and backward, one pass each
DECAY_INTRA = "qkv.recurrent.decay.intra_compiled"  # the decays inside a chunk: cumulative sums, a steep chunk's mask
DECAY_CHANNELS = "qkv.recurrent.decay.channel_compiled"  # the decay backward with a decay a key channel
DELTA_CHANNELS = "qkv.recurrent.delta.channels_compiled"  # the delta rule's forward with a decay a key channel
DPLR = "qkv.recurrent.generalized_delta.compiled"          # the generalized delta rule (dplr)
PRODUCTS = "qkv.kernels.products_compiled"  # a layer's product cut over numba's threads (qkv.nn.products)
FLASH_TASK = "qkv.kernels.flash.task_compiled"  # the tiled forward's bound path, a task's tiles in one call
PRECISE = "qkv.kernels.flash.precise_compiled"  # the precise path's passes over a float64 score tile
CONV = "qkv.kernels.conv_compiled"  # a short causal convolution's decoding step and prefill blocks (causal_conv1d)

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """numba is installed and ``QKV_JIT=0`` is not set."""
    return os.environ.get("QKV_JIT", "1") != "0" and importlib.util.find_spec("numba") is not None


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` (:data:`FLASH`, :data:`ENCODER`, :data:`ROWS`, or the layers'
    ``qkv.nn.fused``), imported at the first
    call, or None where :func:`enabled` is false; the answer is kept for the process."""
    if name in _loaded:  # every tile asks: no lock once loaded
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            if enabled():
                from . import jit_cache
                jit_cache.install()   # the shared cache folder and the compile notice, before numba compiles
            _loaded[name] = importlib.import_module(name) if enabled() else None
    return _loaded[name]


def flash() -> ModuleType | None:
    """:mod:`qkv.kernels.flash.compiled`, or None (numba not installed, or ``QKV_JIT=0``)."""
    return load(FLASH)


def encoder() -> ModuleType | None:
    """:mod:`qkv.models.compiled`, or None (numba not installed, or ``QKV_JIT=0``)."""
    return load(ENCODER)
