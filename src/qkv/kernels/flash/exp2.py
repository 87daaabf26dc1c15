"""The exponential of the score tiles: the one element-wise pass that decides the kernel's speed.

The tiled kernel keeps scores in base 2 and needs, per tile, ``2^(s - m)`` for a column
offset ``m`` (``sub_exp2``) or ``2^s`` (``exp2``), in place. Three ways to compute it, one
chosen per process at the first call (:func:`path` says which) and kept:

- ``"numba"`` (the ``fast`` extra; ``QKV_JIT=0`` turns it off): one compiled pass that
  subtracts the offset, adds each column's sum into ``l`` (the softmax denominators) and evaluates ``2^x = 2^n · 2^f`` with ``n = round(x)``,
  ``f = x - n ∈ [-1/2, 1/2]``, ``2^f`` by a degree-6 polynomial fitted to relative error
  ``2e-9`` on that interval (below float32's rounding, so about 1 ulp in all), and ``2^n``
  written into the exponent bits. Inputs at or below ``-127`` give exactly 0 (never a
  negative or NaN), NaN stays NaN. float32 only: float64 takes NumPy's path. Compiled once
  per machine (numba's on-disk cache), never on ``import qkv``.
- ``"numpy exp2"``: ``np.exp2``, vectorised for float32 only where NumPy has AVX-512.
- ``"numpy exp"``: ``np.exp(x · ln 2)``; on AVX2-only CPUs NumPy's float32 ``exp`` is
  vectorised and ``exp2`` is not (0.44 against 0.22 G elements/s a core, Zen 3).
  Between the two NumPy paths a short measurement at the first call decides.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

LN2 = 0.6931471805599453

# 2^f ≈ Σ c_k f^k on [-1/2, 1/2], least squares on Chebyshev nodes against relative error
# (max 1.9e-9); c_0 = 1 exactly, so 2^0 = 1 exactly.
_COEF = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928,
         0.009618519805371761, 0.0013399859890341759, 0.00015337577497120947)

_lock = threading.Lock()
_chosen: dict = {}


def _numba_kernels():
    """Compile (or load from numba's cache) the float32 passes; None if numba is missing."""
    try:
        import numba
    except ImportError:
        return None
    f32, i32 = np.float32, np.int32
    c0, c1, c2, c3, c4, c5, c6 = (f32(c) for c in _COEF)
    lo, hi = f32(-127.0), f32(127.0)

    @numba.njit(inline="always", fastmath={"contract", "afn", "reassoc", "nsz", "arcp"})
    def pow2(x):
        x = min(max(x, lo), hi)       # NaN passes through both (comparisons with NaN are false)
        n = np.floor(x + f32(0.5))
        f = x - n                     # in [-1/2, 1/2]
        p = ((((((c6 * f + c5) * f + c4) * f + c3) * f + c2) * f + c1) * f + c0)
        bits = (i32(n) + i32(127)) << i32(23)   # 2^n as float bits; n = -127 gives 0.0
        return p * i32(bits).view(f32)

    @numba.njit(nogil=True, cache=True, fastmath={"contract", "afn", "reassoc", "nsz", "arcp"})
    def sub_exp2_sum(st, m, l):       # st (w, R) float32 in place: 2^(st - m[col]); l[col] += Σ_rows
        w, r = st.shape
        for i in range(w):
            for j in range(r):
                p = pow2(st[i, j] - m[j])
                st[i, j] = p
                l[j] += p

    @numba.njit(nogil=True, cache=True, fastmath={"contract", "afn", "reassoc", "nsz", "arcp"})
    def exp2(st):                     # st (w, R) float32 in place: 2^st
        w, r = st.shape
        for i in range(w):
            for j in range(r):
                st[i, j] = pow2(st[i, j])

    @numba.njit(nogil=True, cache=True, fastmath={"contract", "afn", "reassoc", "nsz", "arcp"})
    def band_exp2_sum(st, m, l, k0, r0, shift, lo, hi):  # as sub_exp2_sum where the band allows, else 0
        w, r = st.shape
        for i in range(w):
            for j in range(r):
                d = (k0 + i) - (r0 + j + shift)     # key position minus aligned row position
                if d < -lo or d > hi:
                    st[i, j] = f32(0.0)
                else:
                    p = pow2(st[i, j] - m[j])
                    st[i, j] = p
                    l[j] += p

    tile, row = np.zeros((4, 4), f32), np.zeros(4, f32)
    sub_exp2_sum(tile, row, row.copy())  # compile now (or load), not inside a kernel's tile loop
    exp2(tile)
    band_exp2_sum(tile, row, row.copy(), 0, 0, 0, 0, 0)
    return sub_exp2_sum, exp2, band_exp2_sum


def _np_exp2(x):
    np.exp2(x, out=x)


def _np_exp(x):
    np.multiply(x, x.dtype.type(LN2), out=x)
    np.exp(x, out=x)


def _measure_numpy() -> tuple[str, object]:
    """The faster NumPy float32 exponential on a tile the kernel would use (median of 5)."""
    x = np.random.default_rng(0).uniform(-30, 0, (256, 1024)).astype(np.float32)
    best = None
    for name, fn in (("numpy exp2", _np_exp2), ("numpy exp", _np_exp)):
        times = []
        for _ in range(5):
            y = x.copy()
            t = time.perf_counter()
            fn(y)
            times.append(time.perf_counter() - t)
        t = sorted(times)[2]
        if best is None or t < best[0]:
            best = (t, name, fn)
    return best[1], best[2]


def _choose() -> dict:
    if _chosen:  # every tile asks: no lock once the choice is made
        return _chosen
    with _lock:
        if not _chosen:
            kernels = None if os.environ.get("QKV_JIT", "1") == "0" else _numba_kernels()
            name, fn = _measure_numpy()
            _chosen.update(numpy=fn, numpy_name=name, numba=kernels)
        return _chosen


def path() -> str:
    """Which float32 exponential the kernel uses in this process: ``"numba"``,
    ``"numpy exp2"`` or ``"numpy exp"``."""
    c = _choose()
    return "numba" if c["numba"] is not None else c["numpy_name"]


def exp2(x: np.ndarray) -> None:
    """``x = 2^x`` in place, for a C-contiguous 2-D tile."""
    c = _choose()
    if c["numba"] is not None and x.dtype == np.float32 and x.flags.c_contiguous:
        c["numba"][1](x)
    elif x.dtype == np.float32:
        c["numpy"](x)
    else:
        np.exp2(x, out=x)


def sub_exp2(x: np.ndarray, m: np.ndarray | None, l: np.ndarray | None = None) -> None:
    """``x[i, j] = 2^(x[i, j] - m[j])`` in place, for a C-contiguous tile ``x (w, R)`` (``m``
    None: no offset); with ``l (R,)`` also ``l[j] += Σ_i x[i, j]``, in the same pass where compiled."""
    c = _choose()
    if c["numba"] is not None and x.dtype == np.float32 and x.flags.c_contiguous:
        m = np.zeros(x.shape[1], np.float32) if m is None else m.astype(np.float32, copy=False)
        c["numba"][0](x, m, np.zeros(x.shape[1], np.float32) if l is None else l)
        return
    if m is not None:
        x -= m
    exp2(x)
    if l is not None:
        l += x.sum(axis=0)


_FAR = 1 << 62  # an unbounded side of the band


def band_sub_exp2(x: np.ndarray, m: np.ndarray, k0: int, r0: int, shift: int, lo, hi,
                  l: np.ndarray | None = None) -> bool:
    """``x[i, j] = 2^(x[i, j] - m[j])`` where key ``k0 + i`` lies in the band of row ``r0 + j``
    (``i' - lo <= key <= i' + hi``, ``i' = row + shift``; None: unbounded), else exactly 0: a
    causal or window diagonal masked in the same pass; with ``l``, ``l[j] += Σ_i x[i, j]``.
    False (nothing done) where the compiled path is off; the caller then masks with -inf and
    calls :func:`sub_exp2`."""
    c = _choose()
    if c["numba"] is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        return False
    c["numba"][2](x, m.astype(np.float32, copy=False), np.zeros(x.shape[1], np.float32) if l is None else l,
                  k0, r0, shift, _FAR if lo is None else lo, _FAR if hi is None else hi)
    return True
