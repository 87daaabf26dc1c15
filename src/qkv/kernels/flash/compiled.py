"""numba passes of the tiled kernel (the ``fast`` extra); load it through :func:`qkv.jit.flash` only.

Every pass is a module-level function with ``cache=True``, so numba compiles it once per
machine and later processes load it from ``__pycache__`` (a function built inside another
one would be compiled again by every process). The one scalar function they share, inlined
into each so that LLVM vectorises it, is :func:`pow2`, float32 ``2^x``: ``2^x = 2^n · 2^f``
with ``n = round(x)``, ``f = x - n ∈ [-1/2, 1/2]``, ``2^f`` by a degree-6 polynomial fitted
to relative error ``2e-9`` on that interval (below float32's rounding, so about 1 ulp in
all), and ``2^n`` written into the exponent bits. Inputs at or below ``-127`` give exactly 0
(never a negative or NaN), NaN stays NaN. (The encoder's GELU, :mod:`qkv.models.compiled`,
inlines it too.)

- :func:`sub_exp2_sum`, :func:`exp2`, :func:`band_exp2_sum`: the score tiles' exponential
  (:mod:`.exp2` chooses between them and NumPy);
- :func:`thin_scores`, :func:`thin_values`: the two products of decoding rows (at most
  ``Tiles.thin_rows``), K and V read once each (:mod:`.forward_kernel`).
"""
from __future__ import annotations

import numba
import numpy as np

# contraction into FMAs and vectorised reductions; no "ninf"/"nnan": NaN and inf keep their meaning
FASTMATH = {"contract", "afn", "reassoc", "nsz", "arcp"}
f32, i32 = np.float32, np.int32

# 2^f ≈ Σ c_k f^k on [-1/2, 1/2], least squares on Chebyshev nodes against relative error
# (max 1.9e-9); c_0 = 1 exactly, so 2^0 = 1 exactly.
COEF = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928,
        0.009618519805371761, 0.0013399859890341759, 0.00015337577497120947)
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (f32(c) for c in COEF)
_LO, _HI = f32(-127.0), f32(127.0)


@numba.njit(inline="always", fastmath=FASTMATH)
def pow2(x):
    x = min(max(x, _LO), _HI)         # NaN passes through both (comparisons with NaN are false)
    n = np.floor(x + f32(0.5))
    f = x - n                         # in [-1/2, 1/2]
    p = ((((((_C6 * f + _C5) * f + _C4) * f + _C3) * f + _C2) * f + _C1) * f + _C0)
    bits = (i32(n) + i32(127)) << i32(23)   # 2^n as float bits; n = -127 gives 0.0
    return p * i32(bits).view(f32)


# --- the exponential of a score tile -----------------------------------------------------------
@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def sub_exp2_sum(st, m, l):           # st (w, R) float32 in place: 2^(st - m[col]); l[col] += Σ_rows
    w, r = st.shape
    for i in range(w):
        for j in range(r):
            p = pow2(st[i, j] - m[j])
            st[i, j] = p
            l[j] += p


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def exp2(st):                         # st (w, R) float32 in place: 2^st
    w, r = st.shape
    for i in range(w):
        for j in range(r):
            st[i, j] = pow2(st[i, j])


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def band_exp2_sum(st, m, l, k0, r0, shift, lo, hi):  # as sub_exp2_sum where the band allows, else 0
    w, r = st.shape
    for i in range(w):
        for j in range(r):
            d = (k0 + i) - (r0 + j + shift)          # key position minus aligned row position
            if d < -lo or d > hi:
                st[i, j] = f32(0.0)
            else:
                p = pow2(st[i, j] - m[j])
                st[i, j] = p
                l[j] += p


# --- the products of decoding rows ---------------------------------------------------------------
@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def thin_scores(kk, qs, out):         # out (R, w) = qs (R, D) @ kk (w, D)ᵀ: K read once, every row from L1
    w, d = kk.shape
    r = qs.shape[0]
    for j in range(w):
        for i in range(r):
            s = f32(0.0)
            for t in range(d):
                s += qs[i, t] * kk[j, t]
            out[i, j] = s


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def thin_values(p, vv, acc):          # acc (R, Dv) += p (R, w) @ vv (w, Dv): V read once
    w, dv = vv.shape
    r = p.shape[0]
    for j in range(w):
        for i in range(r):
            pij = p[i, j]
            for t in range(dv):
                acc[i, t] += pij * vv[j, t]
