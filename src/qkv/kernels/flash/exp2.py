"""The exponential of the score tiles: the one element-wise pass that decides the kernel's speed.

The tiled kernel keeps scores in base 2 and needs, per tile, ``2^(s - m)`` for a column
offset ``m`` (``sub_exp2``) or ``2^s`` (``exp2``), in place. Three ways to compute it, one
chosen at the first call by a fixed rule (:func:`path` says which) and kept:

- ``"numba"`` (the ``fast`` extra; ``QKV_JIT=0`` turns it off): one compiled pass that
  subtracts the offset, adds each column's sum into ``l`` (the softmax denominators) and
  evaluates ``2^x`` by :func:`qkv.kernels.flash.compiled.pow2` (a degree-6 polynomial, about
  1 ulp, exactly 0 at or below ``-127``, NaN kept). float32 only: float64 takes NumPy's path.
  Compiled once per machine (numba's on-disk cache), never on ``import qkv``.
- ``"numpy exp2"``: ``np.exp2``, where NumPy runs it on a vector loop for float32 (its
  AVX-512 one; :func:`numpy_exp2_vectorised`).
- ``"numpy exp"``: ``np.exp(x · ln 2)`` everywhere else: NumPy's float32 ``exp`` has AVX2
  and AVX-512 loops, its ``exp2`` a scalar one below AVX-512 (0.44 against 0.22 G
  elements/s a core, Zen 3).

The choice between the two NumPy paths is a rule of the machine and NumPy's build, never a
measurement: they round differently, and a choice by timing at the first call gave some
processes of a loaded machine the other path and other bits (3 of 12 in one trial). Measured
on a (256, 1024) tile (Zen 4, one thread, medians of 41): with AVX-512 ``exp2`` 56 µs
against ``exp`` 134; with NumPy's AVX-512 loops turned off
(``NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"``) ``exp2`` 581 against 303.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np

from ... import jit

LN2 = 0.6931471805599453
_FAR = 1 << 62  # an unbounded side of the band


@dataclass(frozen=True, slots=True)
class Choice:
    """The float32 exponential of this process."""

    name: str                              # what path() reports
    numpy: Callable[[np.ndarray], None]    # NumPy's faster float32 ``x = 2^x`` (for tiles numba cannot take)
    compiled: ModuleType | None            # qkv.kernels.flash.compiled, warmed; None on NumPy's paths

    def takes(self, x: np.ndarray) -> bool:
        """The compiled passes take this tile: float32, C-contiguous."""
        return self.compiled is not None and x.dtype == np.float32 and x.flags.c_contiguous


_lock = threading.Lock()
_chosen: list = []


def _warmed() -> ModuleType | None:
    """The compiled passes, loaded from numba's cache (or compiled once now, not inside a
    kernel's tile loop); None without numba or with QKV_JIT=0."""
    c = jit.flash()
    if c is not None:
        tile, row = np.zeros((4, 4), np.float32), np.zeros(4, np.float32)
        c.sub_exp2_sum(tile, row, row.copy())
        c.exp2(tile)
        c.band_exp2_sum(tile, row, row.copy(), 0, 0, 0, 0, 0)
    return c


def _np_exp2(x):
    np.exp2(x, out=x)


def _np_exp(x):
    np.multiply(x, x.dtype.type(LN2), out=x)
    np.exp(x, out=x)


def numpy_exp2_vectorised() -> bool:
    """Whether NumPy's float32 ``exp2`` runs a vector loop here: from NumPy's dispatch table
    (``numpy.lib.introspect``, NumPy 2.1 on: a target other than the scalar baseline), else
    from its CPU features (AVX-512 Skylake-X's set, where its vector ``exp2`` starts). A
    property of the machine, NumPy's build and ``NPY_DISABLE_CPU_FEATURES``, so the same in
    every process of one machine."""
    try:
        from numpy.lib.introspect import opt_func_info
    except ImportError:
        opt_func_info = None
    if opt_func_info is not None:
        loops = opt_func_info(func_name="^exp2$", signature="float32").get("exp2", {})
        return any(not str(t.get("current", "baseline")).startswith("baseline") for t in loops.values())
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:                                      # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return bool(__cpu_features__.get("AVX512_SKX"))


def _numpy_path() -> tuple[str, Callable]:
    """The NumPy float32 exponential of this machine (see the module docstring)."""
    return ("numpy exp2", _np_exp2) if numpy_exp2_vectorised() else ("numpy exp", _np_exp)


def _choose() -> Choice:
    if _chosen:  # every tile asks: no lock once the choice is made
        return _chosen[0]
    with _lock:
        if not _chosen:
            compiled = _warmed()
            name, fn = _numpy_path()
            _chosen.append(Choice("numba" if compiled is not None else name, fn, compiled))
        return _chosen[0]


def path() -> str:
    """Which float32 exponential the kernel uses in this process: ``"numba"``,
    ``"numpy exp2"`` or ``"numpy exp"``."""
    return _choose().name


def exp2(x: np.ndarray) -> None:
    """``x = 2^x`` in place, for a C-contiguous 2-D tile."""
    c = _choose()
    if c.takes(x):
        c.compiled.exp2(x)
    elif x.dtype == np.float32:
        c.numpy(x)
    else:
        np.exp2(x, out=x)


def sub_exp2(x: np.ndarray, m: np.ndarray | None, l: np.ndarray | None = None) -> None:
    """``x[i, j] = 2^(x[i, j] - m[j])`` in place, for a C-contiguous tile ``x (w, R)`` (``m``
    None: no offset); with ``l (R,)`` also ``l[j] += Σ_i x[i, j]``, in the same pass where compiled."""
    c = _choose()
    if c.takes(x):
        r = x.shape[1]
        c.compiled.sub_exp2_sum(x, np.zeros(r, np.float32) if m is None else m.astype(np.float32, copy=False),
                                np.zeros(r, np.float32) if l is None else l)
        return
    if m is not None:
        x -= m
    exp2(x)
    if l is not None:
        l += x.sum(axis=0, dtype=l.dtype)


def band_sub_exp2(x: np.ndarray, m: np.ndarray, k0: int, r0: int, shift: int, lo, hi,
                  l: np.ndarray | None = None) -> bool:
    """``x[i, j] = 2^(x[i, j] - m[j])`` where key ``k0 + i`` lies in the band of row ``r0 + j``
    (``i' - lo <= key <= i' + hi``, ``i' = row + shift``; None: unbounded), else exactly 0: a
    causal or window diagonal masked in the same pass; with ``l``, ``l[j] += Σ_i x[i, j]``.
    False (nothing done) where the compiled path is off; the caller then masks with -inf and
    calls :func:`sub_exp2`."""
    c = _choose()
    if not c.takes(x):
        return False
    c.compiled.band_exp2_sum(x, m.astype(np.float32, copy=False),
                             np.zeros(x.shape[1], np.float32) if l is None else l,
                             k0, r0, shift, _FAR if lo is None else lo, _FAR if hi is None else hi)
    return True
