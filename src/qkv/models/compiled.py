"""numba passes of the encoder (the ``fast`` extra); load it through :func:`qkv.jit.encoder` only.

Module-level functions with ``cache=True``, compiled once per machine into numba's on-disk
cache, as in :mod:`qkv.kernels.flash.compiled`, whose float32 ``2^x`` (:func:`pow2`, a
degree-6 polynomial, about 1 ulp) they inline. Both follow :mod:`.functional`'s NumPy
formulas: :func:`bias_gelu` is :func:`~.functional.gelu` of ``h + b`` in one pass, and
:func:`add_layer_norm` the residual connection and :func:`~.functional.layer_norm` in one.
"""
from __future__ import annotations

import numba
import numpy as np

from ..kernels.flash.compiled import FASTMATH, pow2, wide_vectors

f32 = np.float32
_HALF_LOG2E = f32(0.5 * 1.4426950408889634)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")  # x/0 without a check: vectorised
def bias_gelu(h, b, ct, c4, c3, c2, c1, c0):  # h (n, f) float32 in place: gelu(h + b), see functional.gelu
    wide_vectors()
    n, f = h.shape
    for i in range(n):
        for j in range(f):
            x = h[i, j] + b[j]
            a = abs(x)
            t = f32(1.0) / (f32(1.0) + ct * a)
            r = t * (c0 + t * (c1 + t * (c2 + t * (c3 + t * c4))))
            r *= pow2(-(a * a) * _HALF_LOG2E) * a     # |x| Φ(-|x|)
            h[i, j] = max(x, f32(0.0)) - r


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def add_layer_norm(x, a, gamma, beta, eps, out):  # out[i] = LayerNorm(x[i] + a[i]), rows of (n, d) float32
    wide_vectors()
    n, d = x.shape
    inv = f32(1.0) / f32(d)
    for i in range(n):
        s = f32(0.0)
        for j in range(d):
            s += x[i, j] + a[i, j]
        mean = s * inv
        v = f32(0.0)
        for j in range(d):
            c = x[i, j] + a[i, j] - mean
            v += c * c
        r = f32(1.0) / np.sqrt(v * inv + eps)
        for j in range(d):
            out[i, j] = (x[i, j] + a[i, j] - mean) * r * gamma[j] + beta[j]
