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
from numba.core import types
from numba.core.extending import intrinsic

from ... import jit_cache

jit_cache.install()  # every compiled module imports this one first: qkv's cache folder before any njit below

# contraction into FMAs and vectorised reductions; no "ninf"/"nnan": NaN and inf keep their meaning
FASTMATH = {"contract", "afn", "reassoc", "nsz", "arcp"}
_IN_ORDER = FASTMATH - {"reassoc"}   # sums added in the order written
f32, i32 = np.float32, np.int32

# 2^f ≈ Σ c_k f^k on [-1/2, 1/2], least squares on Chebyshev nodes against relative error
# (max 1.9e-9); c_0 = 1 exactly, so 2^0 = 1 exactly.
COEF = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928,
        0.009618519805371761, 0.0013399859890341759, 0.00015337577497120947)
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (f32(c) for c in COEF)

# LLVM's tuning for Intel's AVX-512 server cores (Skylake-X to Emerald Rapids) prefers 256-bit
# vectors, so numba's loops there ran at half the width they run at on AMD's Zen 4: pow2 over a
# score row 0.44 ns an entry against 0.30 with 512-bit vectors (Xeon, Emerald Rapids).
_WIDE = '"prefer-vector-width"="512"'


@intrinsic
def wide_vectors(typingctx):
    """Called first in every compiled pass of qkv: LLVM's vectoriser may use 512-bit vectors in the calling
    function (LLVM's per-function "prefer-vector-width"). A CPU without them keeps its widest
    (AVX2: 256); no bit of a result depends on it beyond a vector sum's order."""
    def codegen(context, builder, sig, args):
        # a string attribute: llvmlite's checked add() knows only the enumerated ones
        set.add(builder.function.attributes, _WIDE)
        return context.get_dummy_value()
    return types.none(), codegen
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
    wide_vectors()
    w, r = st.shape
    i = 0
    while i + 4 <= w:                 # four rows a loop: four independent chains of pow2's products in
        for j in range(r):            # flight (one row a loop waited on their latency: 1.7 against
            mj = m[j]                 # 2.2 G entries/s, Zen 3, one thread); the same values
            st[i, j] = pow2(st[i, j] - mj)
            st[i + 1, j] = pow2(st[i + 1, j] - mj)
            st[i + 2, j] = pow2(st[i + 2, j] - mj)
            st[i + 3, j] = pow2(st[i + 3, j] - mj)
        _add_rows4(l, st, i)
        i += 4
    for i in range(i, w):
        for j in range(r):
            st[i, j] = pow2(st[i, j] - m[j])
        _add_row(l, st, i, 0, r)


@numba.njit(inline="always", fastmath=FASTMATH)
def _add_row(l, st, i, j0, j1):       # l[j] += st[i, j] for j in j0:j1, l float64: a loop of its own
    # (in the exponential's loop, the float64 sums kept it from vectorising: 2.1x the time, Zen 3)
    for j in range(j0, j1):
        l[j] += st[i, j]


@numba.njit(nogil=True, cache=True, fastmath=_IN_ORDER)
def _add_rows4(l, st, i):             # l[j] += st[i, j], then rows i+1, i+2, i+3: one row at a time, in
    wide_vectors()                    # order (a function of its own, its flags without "reassoc": the
    for j in range(st.shape[1]):      # bits of row by row)
        l[j] = (((l[j] + st[i, j]) + st[i + 1, j]) + st[i + 2, j]) + st[i + 3, j]


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def exp2(st):                         # st (w, R) float32, C-contiguous, in place: 2^st
    wide_vectors()
    x = st.reshape(st.size)           # one flat loop (a view: numba refuses to reshape a strided array),
    for j in range(x.size):           # which LLVM interleaves: 3.7 against 2.9 G entries/s row by row
        x[j] = pow2(x[j])             # (Zen 3, one thread); the same values


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def band_exp2_sum(st, m, l, k0, r0, shift, lo, hi):  # as sub_exp2_sum where the band allows, else 0
    wide_vectors()
    w, r = st.shape
    for i in range(w):
        ja, jb = _band(k0 + i, r0, shift, lo, hi, r)
        if ja >= jb:
            _zero_row(st, i, 0, r)
            continue
        for j in range(r):                   # the whole row, then 0 outside the band: loops over
            st[i, j] = pow2(st[i, j] - m[j])  # ja:jb ran their odd ends scalar, 3-4x the time
        _zero_row(st, i, 0, ja)
        _zero_row(st, i, jb, r)
        _add_row(l, st, i, 0, r)             # (+0.0 leaves a sum's bits as they are)


@numba.njit(inline="always")
def _band(key, r0, shift, lo, hi, r):  # the rows ja:jb of r0:r0+r whose band holds key:
    d0 = key - (r0 + shift)                 # -lo <= key - (row + shift) <= hi
    ja = min(max(d0 - hi, 0), r)
    return ja, min(max(d0 + lo + 1, ja), r)


@numba.njit(inline="always")
def _zero_row(st, i, j0, j1):
    for j in range(j0, j1):
        st[i, j] = f32(0.0)


# --- the products of decoding rows ---------------------------------------------------------------
@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def thin_scores(kk, qs, out):         # out (R, w) = qs (R, D) @ kk (w, D)ᵀ: K read once, every row from L1
    wide_vectors()
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
    wide_vectors()
    w, dv = vv.shape
    r = p.shape[0]
    for j in range(w):
        for i in range(r):
            pij = p[i, j]
            for t in range(dv):
                acc[i, t] += pij * vv[j, t]


# --- softcap and dropout (qkv.score_ops): the tile passes of a problem that uses them -----------
# tanh(y) = y + y³·R(y²) for |y| < 0.625 (R of degree 4, least squares on Chebyshev nodes against
# relative error: at most 1.4 units of 2^-24), else sign(y)·(1 - 2 / (2^(2·log2(e)·|y|) + 1));
# both branches are evaluated and one selected, so the loop vectorises (with error_model="numpy":
# numba's default guards every division by a zero test, a branch that kept these loops scalar,
# 40x slower). NaN stays NaN.
_T0, _T1, _T2, _T3, _T4 = (f32(c) for c in (-0.3333328664302826, 0.13331513106822968, -0.05374465882778168,
                                            0.020653124898672104, -0.0057189627550542355))
# TSPLIT: tanh32 takes its first branch below it (public: the row kernel's softcap pass tests it too)
_TWO_LOG2E, TSPLIT = f32(2.0 * 1.4426950408889634), f32(0.625)
u32 = np.uint32


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def tanh_small(y):                     # tanh32's first branch alone: |y| < TSPLIT (or NaN)
    z = y * y
    return y + y * z * ((((_T4 * z + _T3) * z + _T2) * z + _T1) * z + _T0)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def tanh32(y):
    a = abs(y)
    big = f32(1.0) - f32(2.0) / (pow2(_TWO_LOG2E * a) + f32(1.0))
    big = big if y >= f32(0.0) else -big
    return tanh_small(y) if a < TSPLIT else big


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def tanh_any(y, small):                # tanh32, or its first branch where the caller knows |y| < TSPLIT
    return tanh_small(y) if small else tanh32(y)


@numba.njit(inline="always")
def abs_max(x):
    """max |x| of a contiguous 1-D float32 array, from the bits with the sign cleared: an
    integer max vectorises (0.08 ns an entry), numba's float max does not (0.54). Non-negative
    floats order as their bits; a NaN's bits exceed inf's, so a NaN gives NaN."""
    xi = x.view(np.int32)
    m = i32(0)
    for j in range(xi.shape[0]):
        b = xi[j] & i32(0x7FFFFFFF)
        m = b if b > m else m
    return np.array([m], np.int32).view(np.float32)[0]


@numba.njit(inline="always", fastmath=FASTMATH)
def all_small(x, inv):
    """Whether every ``|x·inv| < TSPLIT`` of a contiguous tile ``x (w, R)`` (inv > 0): the
    largest ``|x|`` times ``inv`` is, and rounding keeps the order, so tanh32 would take its
    first branch on every entry. Most softcapped tiles are such (Gemma 2's cap of 50 against
    scores within ±31): they skip the exponential branch, the same bits for a third of the
    work. A NaN makes it False (tanh32 then gives NaN there, as the first branch would)."""
    return abs_max(x.ravel()) * inv < TSPLIT


@numba.njit(inline="always")
def keep_bits(klo, khi, col):          # qkv.score_ops.bits for one entry, in 32-bit arithmetic
    x = u32(u32(klo ^ u32(u32(col) * u32(0x9E3779B1))) + khi)
    x = u32(x ^ (x >> u32(16)))
    x = u32(x * u32(0x85EBCA6B))
    x = u32(x ^ (x >> u32(13)))
    x = u32(x * u32(0xC2B2AE35))
    return u32(x ^ (x >> u32(16)))


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def softcap_tile(st, g, cap, grad):    # st (w, R) in place: cap·tanh(st / cap); grad: g = 1 - tanh²
    wide_vectors()
    inv = f32(1.0) / cap
    if all_small(st, inv):
        _softcap_body(st, g, cap, inv, grad, True)
    else:
        _softcap_body(st, g, cap, inv, grad, False)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _softcap_body(st, g, cap, inv, grad, small):
    w, r = st.shape
    for i in range(w):
        for j in range(r):
            t = tanh_any(st[i, j] * inv, small)
            st[i, j] = cap * t
            if grad:
                g[i, j] = f32(1.0) - t * t


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, capped, drop, small, banded):
    w, r = st.shape
    inv = f32(1.0) / cap if capped else f32(0.0)
    for i in range(w):
        ja, jb = _band(k0 + i, r0, shift, lo, hi, r) if banded else (0, r)
        if ja >= jb:
            _zero_row(st, i, 0, r)
            continue
        for j in range(r):                           # the whole row, then 0 outside the band (see band_exp2_sum)
            x = st[i, j]
            if capped:
                x = cap * tanh_any(x * inv, small)
            st[i, j] = pow2(x - m[j])
        if banded:
            _zero_row(st, i, 0, ja)
            _zero_row(st, i, jb, r)
        _add_row(l, st, i, 0, r)
        if drop:
            for j in range(r):
                st[i, j] = st[i, j] * zscale if keep_bits(klo[j], khi[j], col0 + i) >= thresh else f32(0.0)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _fwd_cases(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, drop, small, banded):
    if cap > f32(0.0) and drop and small:
        _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, True, True, True, banded)
    elif cap > f32(0.0) and drop:
        _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, True, True, False, banded)
    elif cap > f32(0.0) and small:
        _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, True, False, True, banded)
    elif cap > f32(0.0):
        _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, True, False, False, banded)
    else:
        _fwd_body(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, False, True, False, banded)


_UNBOUNDED = 1 << 62                    # a band side this far is no band (modifiers._FAR)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def mod_exp2_sum(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, drop):
    wide_vectors()
    # st (w, R) in place, the forward's tile: x = cap·tanh(st / cap) where cap > 0; 2^(x - m[col])
    # inside the band (else 0), l[col] += Σ_rows; then times keep / (1 - p) where drop. Each case
    # its own loop (the flags are constants of the inlined body), so that each vectorises.
    small = cap > f32(0.0) and all_small(st, f32(1.0) / cap)   # no tile entry reaches tanh's second branch
    if lo < _UNBOUNDED or hi < _UNBOUNDED:
        _fwd_cases(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, drop, small, True)
    else:
        _fwd_cases(st, m, l, cap, k0, r0, shift, lo, hi, klo, khi, col0, thresh, zscale, drop, small, False)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, capped, drop, small, sums):
    w, r = et.shape
    inv = f32(1.0) / cap if capped else f32(0.0)
    for i in range(w):
        for j in range(r):
            x = et[i, j]
            t = f32(0.0)
            if capped:
                t = tanh_any(x * inv, small)
                x = cap * t
            p = pow2((x + nhi[j]) + nlo[j])
            et[i, j] = p
            if capped:
                g[i, j] = p * (f32(1.0) - t * t)      # P ∘ (1 - tanh²): dS's two factors in one
            if drop:
                z[i, j] = zscale if keep_bits(klo[j], khi[j], col0 + i) >= thresh else f32(0.0)
        if sums:
            _add_row(l, et, i, 0, r)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _grad_cases(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, drop, small, sums):
    if cap > f32(0.0) and drop and small:
        _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, True, True, True, sums)
    elif cap > f32(0.0) and drop:
        _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, True, True, False, sums)
    elif cap > f32(0.0) and small:
        _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, True, False, True, sums)
    elif cap > f32(0.0):
        _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, True, False, False, sums)
    else:
        _grad_body(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, False, True, False, sums)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def mod_grad_exp2(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, drop):
    wide_vectors()
    # et (w, R) in place, the backward's tile: x = cap·tanh(et / cap) (g = P ∘ (1 - tanh²)) where cap > 0;
    # P = 2^((x + nhi[col]) + nlo[col]), l[col] += Σ_rows unless l is empty; z = keep / (1 - p) where drop
    small = cap > f32(0.0) and all_small(et, f32(1.0) / cap)   # no tile entry reaches tanh's second branch
    if l.shape[0] > 0:
        _grad_cases(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, drop, small, True)
    else:
        _grad_cases(et, z, g, nhi, nlo, l, cap, klo, khi, col0, thresh, zscale, drop, small, False)


@numba.njit(nogil=True, cache=True)   # no fastmath: nothing contracted, each step rounded as NumPy's
def scores_grad(dst, z, d, f, p, drop):   # dst (w, R) = ((dst ∘ z where drop) + d[col]) ∘ f, in place, and
    wide_vectors()                        # z = p ∘ z where drop: the backward's dS with softcap or dropout,
    w, r = dst.shape                      # and dV's P ∘ Z, in one pass, not four
    for i in range(w):
        if drop:
            for j in range(r):
                zij = z[i, j]
                dst[i, j] = (dst[i, j] * zij + d[j]) * f[i, j]
                z[i, j] = p[i, j] * zij
        else:
            for j in range(r):
                dst[i, j] = (dst[i, j] + d[j]) * f[i, j]
