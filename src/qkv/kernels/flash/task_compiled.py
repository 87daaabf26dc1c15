"""The tiled forward's bound path, a task's every tile in one compiled call (numba).

Load it through ``qkv.jit.load(qkv.jit.FLASH_TASK)`` only; :mod:`.bound_tiles` says when it is
used. Each tile is what the Python loop makes of it (:func:`.bound_tiles.tile`), in the same
order: ``S = K_c Qᵀ`` (BLAS ``sgemm`` through its address, the arguments NumPy's ``matmul``
passes), ``2^(S - m)`` with the row sums by :mod:`.compiled`'s passes (the band's where a causal
or window diagonal crosses the tile), then ``Sᵀ V_c`` into a scratch block added to ``acc``
entry by entry, as ``acc += P.T @ V`` does. So the bits are the loop's.

Why: a task's Python holds the GIL between its products, and at two threads the two tasks'
Python queued on it. A causal forward at (1, 8, 4096, 64) on a 2-core Zen 3 spent 1.15-1.25x
its one-thread time summed over two threads (its diagonal's 128-row pieces are short
products with Python between them), where two processes of one thread each lost nothing.
Softcap and dropout stay on the loop: an entry of their own compiled in 27.6 s of CPU (their
pass's ten bodies compiled into it again), for 3-9 % of their forward.
"""
from __future__ import annotations

import numba
import numpy as np

from ... import jit_cache

jit_cache.install()  # as every compiled module: qkv's cache folder (and TBB, qkv.threads.prefer_tbb) before its njit

from ..blas_compiled import ILP64, N_, SGEMM, T_, gemm  # noqa: E402
from .compiled import band_exp2_sum, sub_exp2_sum  # noqa: E402

ADDR = (SGEMM, ILP64)


@numba.njit(nogil=True, cache=True)
def bound_task(addr, qs, kk, vv, m, acc, l, pieces, shift, lo, hi, st, tmp):
    """The tiles ``pieces[p] = (k0, k1, i0, i1, r0, band)`` of one task, in order: keys
    ``k0:k1`` against the stacked rows ``i0:i1`` of ``qs`` (C-contiguous float32, scaled to
    base 2), query row ``r0`` the first of them (the band's), ``band`` 1 where the diagonal
    ``-lo <= key - (row + shift) <= hi`` masks the tile. Adds ``Σ_j 2^(s_ij - m_i) v_j`` into
    ``acc`` and ``Σ_j 2^(s_ij - m_i)`` into ``l`` (float64); ``st`` a flat scratch of the
    largest tile, ``tmp`` at least ``(rows, Dv)``."""
    d, dv = qs.shape[1], vv.shape[1]
    for p in range(pieces.shape[0]):
        k0, k1, i0, i1, r0, band = pieces[p, 0], pieces[p, 1], pieces[p, 2], pieces[p, 3], pieces[p, 4], pieces[p, 5]
        w, r = k1 - k0, i1 - i0
        s = st[:w * r].reshape((w, r))
        gemm(addr, N_, T_, w, r, d, kk[k0:k1], qs[i0:i1], 0.0, s)       # (w, D) @ (D, r): the tile, transposed
        if band:
            band_exp2_sum(s, m[i0:i1], l[i0:i1], k0, r0, shift, lo, hi)
        else:
            sub_exp2_sum(s, m[i0:i1], l[i0:i1])
        t = tmp[:r]
        gemm(addr, T_, N_, r, dv, w, s, vv[k0:k1], 0.0, t)             # (r, w) @ (w, Dv): Σ p v
        for i in range(r):
            for j in range(dv):
                acc[i0 + i, j] += t[i, j]


@numba.njit(nogil=True, cache=True, error_model="numpy")
def finish(acc, l, least, out, ok):
    """The bound path's rows in one pass: ``out = acc / l`` (float32 ``acc`` over float64 ``l``,
    divided in float64 and rounded once, as NumPy's ``(acc / l[:, None]).astype(float32)``) and
    ``ok[i]``: ``l_i >= least`` and every ``acc_i`` and ``l_i`` finite. Returns whether every
    ``out`` entry is finite."""
    finite = True
    for i in range(acc.shape[0]):
        li = l[i]
        fine = np.isfinite(li)
        for j in range(acc.shape[1]):
            a = acc[i, j]
            fine &= np.isfinite(a)
            o = np.float32(np.float64(a) / li)
            out[i, j] = o
            finite &= np.isfinite(o)
        ok[i] = fine and li >= least
    return finite


@numba.njit(nogil=True, cache=True)
def scaled_rows(q, sc, qs):
    """``qs = q · sc`` (float32, rounded as NumPy's product) and the largest row's ``Σ_j qs_ij²``
    in float64; NaN where any product is NaN (inf where one is inf)."""
    top = 0.0
    for i in range(q.shape[0]):
        s = 0.0
        for j in range(q.shape[1]):
            x = q[i, j] * sc
            qs[i, j] = x
            s += np.float64(x) * np.float64(x)
        if s != s:
            return s
        top = max(top, s)
    return top

