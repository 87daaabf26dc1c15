"""A layer's 2-D float32 product cut in pieces of its rows on numba's threads, each piece one
``sgemm`` on one BLAS thread; load it through ``qkv.jit.load(qkv.jit.PRODUCTS)`` only
(:mod:`qkv.nn.products` says when it is used, why, and where the pieces may be cut so that
every entry keeps the bits of the whole product).
"""
from __future__ import annotations

import numba
from numba import prange

from .. import jit_cache

jit_cache.install()  # as every compiled module: qkv's cache folder (and TBB, qkv.threads.prefer_tbb) before its njit

from .blas_compiled import ILP64, N_, SGEMM, T_, gemm, threading_layer  # noqa: E402

LAYER = threading_layer()
CONCURRENT = LAYER in ("omp", "tbb")   # several Python threads may call at once (else NumPy's product)
ADDR = (SGEMM, ILP64)


@numba.njit(parallel=True, nogil=True, cache=True)
def split_gemm(addr, ta, tb, a, b, c, bounds):
    """``c = op(a) op(b)`` (``op(x) = xᵀ`` where the flag is :data:`T_`; ``a``, ``b``, ``c``
    C-contiguous float32, ``op(a)`` ``m × k``), c's rows ``bounds[p]:bounds[p + 1]`` a piece,
    the pieces on numba's threads (the caller sets their count and holds BLAS to one)."""
    n = c.shape[1]
    k = a.shape[0] if ta == T_ else a.shape[1]
    for p in prange(bounds.shape[0] - 1):
        r0, r1 = bounds[p], bounds[p + 1]
        if ta == N_:
            gemm(addr, ta, tb, r1 - r0, n, k, a[r0:r1], b, 0.0, c[r0:r1])
        else:
            gemm(addr, ta, tb, r1 - r0, n, k, a[:, r0:r1], b, 0.0, c[r0:r1])
