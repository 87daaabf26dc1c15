"""numba passes of the delta-rule kernel (:mod:`qkv.kernels.delta_chunks`); load it through
``qkv.jit.load(qkv.jit.DELTA)`` only.

:func:`unit_lower_inverse`: ``(I + A)⁻¹`` of every chunk's strictly lower triangular ``A`` by
forward substitution, a row at a time, in ``A``'s place: ``X_i = e_iᵀ - A[i, :i] X[:i]`` (row
i of ``X (I + A) = I``). Each row is a sum of the rows above it, a vector loop of i numbers;
NumPy's path doubles the inverted blocks instead, in ``log2 C`` rounds of small batched
products (at C = 64, eight heads of T = 2048: about half the time here).
"""
from __future__ import annotations

import numba
import numpy as np

from .flash.compiled import wide_vectors


@numba.njit(nogil=True, cache=True, fastmath={"contract", "nsz"})
def unit_lower_inverse(A):
    """``A (M, C, C)`` C-contiguous: each ``A[m]`` replaced by ``(I + tril(A[m], -1))⁻¹`` (what is
    on and above the diagonal is not read)."""
    wide_vectors()
    M, C, _ = A.shape
    a = np.empty(C, A.dtype)
    for m in range(M):
        x = A[m]
        for i in range(C):
            row = x[i]
            for k in range(i):
                a[k] = -row[k]
            for j in range(C):
                row[j] = 0
            row[i] = 1
            for k in range(i):
                src, f = x[k], a[k]
                for j in range(i):          # src[j] = 0 for j > k: a fixed-length vector loop
                    row[j] += f * src[j]
