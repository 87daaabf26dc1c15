"""numba passes of the layers (the ``fast`` extra); load it through :func:`qkv.nn.fusion.compiled` only.

Each function is one loop over memory doing what the NumPy path beside its caller does in
several passes with temporaries, with the same formulas (see :mod:`qkv.nn.norms`,
:mod:`qkv.nn.activations`, :class:`qkv.nn.AdamW`, :func:`softmax_cross_entropy`). They take
C-contiguous float32 or float64 arrays (flattened or ``(rows, d)``) and write into the
output arrays they are given; scalars come in the arrays' dtype, so float32 stays float32.
Module-level ``njit`` with ``cache=True``: compiled once per machine into numba's on-disk
cache (``__pycache__`` beside this file), loaded from it by later processes.

The tanh GELU's forward is compiled for float32 only, with ``tanh(u) = 1 - 2 / (1 + 2^(2u log2 e))``
and the vectorised ``2^x`` of the flash kernel (:func:`qkv.kernels.flash.compiled.pow2`): a
compiled ``math.tanh`` would call the scalar libm routine (4x slower than NumPy's passes);
float64 keeps NumPy's SIMD ``np.tanh``. Near ``u = 0`` that formula's ``tanh`` is exact to
float32's rounding in absolute terms (~6e-8), which is what ``h (1 + tanh(u)) / 2`` needs.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ..kernels.flash.compiled import COEF, FASTMATH, pow2, wide_vectors

FLAGS = {"nsz", "contract", "reassoc", "arcp"}  # reassociation lets LLVM vectorise the row sums
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@numba.njit(nogil=True, cache=True, fastmath=FLAGS)
def layer_norm_forward(x, w, b, eps, y, xhat, r):  # rows of x (n, d): y = (x - mu) r w + b
    wide_vectors()
    n, d = x.shape
    inv_d = 1.0 / d
    for i in range(n):
        s = 0.0
        for j in range(d):
            s += x[i, j]
        mu = s * inv_d
        v = 0.0
        for j in range(d):
            c = x[i, j] - mu
            v += c * c
        ri = 1.0 / math.sqrt(v * inv_d + eps)
        r[i] = ri
        for j in range(d):
            h = (x[i, j] - mu) * ri
            xhat[i, j] = h
            y[i, j] = h * w[j] + b[j]


@numba.njit(nogil=True, cache=True, fastmath=FLAGS)
def layer_norm_backward(dy, xhat, r, w, dx, dw, db):  # dx = r (g - mean(g) - x̂ mean(g x̂)), g = dy w
    wide_vectors()
    n, d = dy.shape
    inv_d = 1.0 / d
    for i in range(n):
        sg = 0.0
        sgx = 0.0
        for j in range(d):
            g = dy[i, j] * w[j]
            sg += g
            sgx += g * xhat[i, j]
            dw[j] += dy[i, j] * xhat[i, j]   # float64 accumulators
            db[j] += dy[i, j]
        mg, mgx = sg * inv_d, sgx * inv_d
        for j in range(d):
            dx[i, j] = r[i] * (dy[i, j] * w[j] - mg - xhat[i, j] * mgx)


# pow2's flags ("afn" keeps its floor a vector op); error_model="numpy": no zero-division
# check on the division, which would keep the loop scalar
@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _tanh_u32(x):  # float32 tanh(√(2/π) (x + 0.044715 x³)) = 1 - 2 / (1 + 2^(2u log2 e))
    k0 = np.float32(SQRT_2_OVER_PI)
    k1 = np.float32(SQRT_2_OVER_PI * GELU_CUBIC)
    c = np.float32(2.0 / math.log(2.0))
    one = np.float32(1.0)
    return one - np.float32(2.0) / (one + pow2(c * (x * (k0 + k1 * x * x))))


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gelu_tanh_forward32(h, y):  # float32: y = h (1 + tanh(u)) / 2
    wide_vectors()
    half, one = np.float32(0.5), np.float32(1.0)
    for i in range(h.size):
        x = h[i]
        y[i] = half * x * (one + _tanh_u32(x))


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gelu_tanh_backward32(dy, h, dh):  # float32, tanh(u) computed again: as gelu_tanh_backward
    wide_vectors()
    k0 = np.float32(SQRT_2_OVER_PI)
    k1 = np.float32(3.0 * SQRT_2_OVER_PI * GELU_CUBIC)
    half, one = np.float32(0.5), np.float32(1.0)
    for i in range(h.size):
        x = h[i]
        ti = _tanh_u32(x)
        dh[i] = dy[i] * half * (one + ti + x * (one - ti * ti) * (k0 + k1 * x * x))


@numba.njit(nogil=True, cache=True, fastmath=FLAGS)
def gelu_tanh_backward(dy, h, t, dh):  # dy ((1 + t)/2 + h (1 - t²) √(2/π) (1 + 3 c h²) / 2)
    wide_vectors()
    k0 = SQRT_2_OVER_PI
    k1 = 3.0 * SQRT_2_OVER_PI * GELU_CUBIC
    for i in range(h.size):
        x, ti = h[i], t[i]
        dh[i] = dy[i] * 0.5 * (1.0 + ti + x * (1.0 - ti * ti) * (k0 + k1 * x * x))


# The exact GELU of float32 input, computed in float64 and rounded once (within 1 ulp; 98.7 % of
# results as math.erf's, the scalar libm call of 6 ns an element on Zen 3 that gelu_forward makes):
# Φ(h) = erfc(-h/√2) / 2 with erfc(x) = t e^{g(t) - x²}, t = 1/(1 + x/2) for x >= 0 (Numerical
# Recipes' erfcc form), g a degree-12 polynomial fitted here (least squares on Chebyshev nodes over
# x in [0, 10.5], beyond which Φ is below float32's least value) to ln(erfc(x) e^{x²} / t), at most
# 2e-10 off; e^y as 2^(y log2 e) by _exp2_64. Every step a 4-wide vector operation on AVX2. Both
# polynomials by Estrin's scheme (powers of t, pairs of terms): Horner's chain of 12 + 7 dependent
# products kept the loop waiting on the FMA latency, 4.3 ns an element against 2.8 (Zen 3, one
# thread); its float64 sums round differently, and none of 16 million float32 results moved.
_G = (-1.2655050568787076, 0.9997507165060272, 0.3789204029012229, 0.04698990089337306,
      0.13518813586484024, -1.0730590840579324, 2.6669186367508217, -5.7626829117424965,
      8.553271240350767, -7.896199762945475, 4.407409690108242, -1.3775625589137899, 0.1865606513464779)
_G0, _G1, _G2, _G3, _G4, _G5, _G6, _G7, _G8, _G9, _G10, _G11, _G12 = _G
# 2^f on [-1/2, 1/2], degree 7, least squares against relative error (at most 4e-11)
_X = (0.9999999999619437, 0.6931471807388332, 0.24022651196252776, 0.05550410319487603,
      0.009618027457979562, 0.0013333950083588124, 0.00015469236489339556, 1.5195577489589078e-05)
_X0, _X1, _X2, _X3, _X4, _X5, _X6, _X7 = _X
_LOG2E = 1.0 / math.log(2.0)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _exp2_64(a):  # float64 2^a, exactly 0 below -1022; NaN stays NaN
    n = np.floor(max(a, -1022.0) + 0.5)
    f = a - n
    f2 = f * f                        # Estrin's scheme: a dependency chain of 4 products, not Horner's 7
    p = ((_X0 + _X1 * f) + (_X2 + _X3 * f) * f2) + ((_X4 + _X5 * f) + (_X6 + _X7 * f) * f2) * (f2 * f2)
    # 2^n from the bits: n + 1023 as the low mantissa bits of a float near 2^52, shifted into the
    # exponent (an int64 conversion would be a scalar instruction on AVX2)
    bits = np.float64((n + 1023.0) + 4503599627370496.0).view(np.int64) << np.int64(52)
    return 0.0 if a < -1022.0 else p * np.int64(bits).view(np.float64)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _phi(h):  # Φ(h) in float64 for a float32 h (see above); 0 below -14.8, where Φ < 1e-49
    x2 = 0.5 * h * h                                              # x² = h²/2: exact for a float32 h
    x = min(abs(h) * INV_SQRT_2, 10.5)
    t = 1.0 / (1.0 + 0.5 * x)
    t2 = t * t                                                    # Estrin's scheme (see above)
    t4 = t2 * t2
    g = (((_G0 + _G1 * t) + (_G2 + _G3 * t) * t2) + ((_G4 + _G5 * t) + (_G6 + _G7 * t) * t2) * t4) + \
        (((_G8 + _G9 * t) + (_G10 + _G11 * t) * t2) + _G12 * t4) * (t4 * t4)
    e = t * _exp2_64((g - min(x2, 110.25)) * _LOG2E)              # erfc(|h|/√2)
    return (0.0 if h < -14.8 else 0.5 * e) if h < 0 else 1.0 - 0.5 * e


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gelu_forward32(h, y, cdf):  # float32: y = h Φ(h)
    wide_vectors()
    for i in range(h.size):
        x = np.float64(h[i])
        c = _phi(x)
        cdf[i] = c
        y[i] = x * c


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def gelu_backward32(dy, h, cdf, dh):  # float32: dy (Φ(h) + h φ(h)), φ(h) = 2^(-h²/2 · log2 e) / √(2π)
    wide_vectors()
    for i in range(h.size):
        x = np.float64(h[i])
        dh[i] = dy[i] * (cdf[i] + x * INV_SQRT_2PI * _exp2_64(-0.5 * x * x * _LOG2E))


@numba.njit(nogil=True, cache=True)
def gelu_forward(h, y, cdf):  # y = h Φ(h), Φ(h) = (1 + erf(h/√2)) / 2
    wide_vectors()
    for i in range(h.size):
        c = 0.5 * (1.0 + math.erf(h[i] * INV_SQRT_2))
        cdf[i] = c
        y[i] = h[i] * c


@numba.njit(nogil=True, cache=True)
def gelu_backward(dy, h, cdf, dh):  # dy (Φ(h) + h φ(h))
    wide_vectors()
    for i in range(h.size):
        x = h[i]
        dh[i] = dy[i] * (cdf[i] + x * INV_SQRT_2PI * math.exp(-0.5 * x * x))


@numba.njit(nogil=True, cache=True, fastmath=FLAGS, error_model="numpy")  # no zero check: a vector loop
def adamw_update(p, g, m, v, coef, shrink, b1, c1, b2, c2, step_size, root_c2, eps):  # c1 = 1 - b1, c2 = 1 - b2
    wide_vectors()
    for i in range(p.size):
        gi = g[i] * coef                                  # clipped gradient
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * shrink - step_size * mi / (math.sqrt(vi) / root_c2 + eps)


@numba.njit(nogil=True, cache=True)
def softmax_cross_entropy(logits, targets, dlogits):  # -> Σ_rows lse - logit[target]; dlogits
    wide_vectors()
    n, c = logits.shape
    total = 0.0
    inv_n = 1.0 / n
    for i in range(n):
        mx = logits[i, 0]
        for j in range(1, c):
            mx = max(mx, logits[i, j])
        s = 0.0
        for j in range(c):
            e = math.exp(logits[i, j] - mx)
            dlogits[i, j] = e
            s += e
        total += mx + math.log(s) - logits[i, targets[i]]
        scale = inv_n / s
        for j in range(c):
            dlogits[i, j] *= scale
        dlogits[i, targets[i]] -= inv_n
    return total * inv_n


# --- the recurrent layers' SiLU and short convolution ------------------------------------------
_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (np.float32(c) for c in COEF)
_NEG_LOG2E = -1.0 / math.log(2.0)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _sigmoid32(x):  # float32 1 / (1 + 2^y), y = -x log2 e formed in float64 (σ = 0 below x ≈ -88, 1 above 88)
    # The flash kernel's 2^x polynomial (COEF), its argument split in float64: y = n + f exactly
    # enough that σ keeps float32's few ulps where x log2 e rounded in float32 would cost |y| ulps.
    raw = np.float64(x) * _NEG_LOG2E
    y = min(max(raw, -127.0), 127.0)                             # NaN passes through both
    n = np.floor(y + 0.5)
    f = np.float32(y - n)                                        # in [-1/2, 1/2]
    p = ((((((_E6 * f + _E5) * f + _E4) * f + _E3) * f + _E2) * f + _E1) * f + _E0)
    bits = (np.int32(n) + np.int32(127)) << np.int32(23)         # 2^n as float bits; n = -127 gives 0.0
    one = np.float32(1.0)
    s = one / (one + p * np.int32(bits).view(np.float32))
    return np.float32(0.0) if raw > 127.0 else s                 # 2^y past float32's range: σ is 0 (NaN keeps s)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def silu_forward32(a, y):  # float32: y = a σ(a)
    wide_vectors()
    for i in range(a.size):
        x = a[i]
        y[i] = x * _sigmoid32(x)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def silu_backward32(dy, a, dh):  # float32, σ(a) computed again: dy σ (1 + a (1 - σ))
    wide_vectors()
    one = np.float32(1.0)
    for i in range(a.size):
        x = a[i]
        s = _sigmoid32(x)
        dh[i] = dy[i] * s * (one + x * (one - s))


# The float32 activations above in ``parts`` pieces on numba's threads (qkv.nn.fusion.passes:
# one pool with the layers' products, qkv.nn.products); element-wise, so the same bits.
@numba.njit(inline="always")
def _cut(n, parts, p):
    return n * p // parts, n * (p + 1) // parts


@numba.njit(nogil=True, cache=True, parallel=True)
def gelu_forward32_parts(h, y, cdf, parts):
    for p in numba.prange(parts):
        a, b = _cut(h.size, parts, p)
        gelu_forward32(h[a:b], y[a:b], cdf[a:b])


@numba.njit(nogil=True, cache=True, parallel=True)
def gelu_backward32_parts(dy, h, cdf, dh, parts):
    for p in numba.prange(parts):
        a, b = _cut(h.size, parts, p)
        gelu_backward32(dy[a:b], h[a:b], cdf[a:b], dh[a:b])


@numba.njit(nogil=True, cache=True, parallel=True)
def gelu_tanh_forward32_parts(h, y, parts):
    for p in numba.prange(parts):
        a, b = _cut(h.size, parts, p)
        gelu_tanh_forward32(h[a:b], y[a:b])


@numba.njit(nogil=True, cache=True, parallel=True)
def gelu_tanh_backward32_parts(dy, h, dh, parts):
    for p in numba.prange(parts):
        a, b = _cut(h.size, parts, p)
        gelu_tanh_backward32(dy[a:b], h[a:b], dh[a:b])


@numba.njit(nogil=True, cache=True, parallel=True)
def silu_forward32_parts(a, y, parts):
    for p in numba.prange(parts):
        i, j = _cut(a.size, parts, p)
        silu_forward32(a[i:j], y[i:j])


@numba.njit(nogil=True, cache=True, parallel=True)
def silu_backward32_parts(dy, a, dh, parts):
    for p in numba.prange(parts):
        i, j = _cut(a.size, parts, p)
        silu_backward32(dy[i:j], a[i:j], dh[i:j])


@numba.njit(nogil=True, cache=True, fastmath=FLAGS)
def causal_conv(padded, wt, bias, y):  # y[b, t] = bias + Σ_j wt[j] ∘ padded[b, t + j]; padded (B, K-1+T, C)
    wide_vectors()
    B, T, C = y.shape
    for b in range(B):
        for t in range(T):
            row = y[b, t]
            for c in range(C):
                row[c] = bias[c]
            for j in range(wt.shape[0]):
                src, w = padded[b, t + j], wt[j]
                for c in range(C):
                    row[c] += w[c] * src[c]


@numba.njit(nogil=True, cache=True, fastmath=FLAGS)
def causal_conv_backward(dy, padded, wt, du, dwt):  # du[b, s] = Σ_j wt[j] ∘ dy[b, s + K-1-j]; dwt[j] = Σ dy ∘ ũ_{+j}
    # dwt: float64 (K, C), the taps' sums over B·T rows kept in float64 whatever dy's dtype
    wide_vectors()
    B, T, C = dy.shape
    K = wt.shape[0]
    dwt[...] = 0
    for b in range(B):
        for t in range(T):
            g = dy[b, t]
            for j in range(K):
                src, acc = padded[b, t + j], dwt[j]
                for c in range(C):
                    acc[c] += g[c] * src[c]
        for s in range(T):
            row = du[b, s]
            for c in range(C):
                row[c] = 0
            for j in range(K):
                t = s + K - 1 - j
                if t < T:
                    g, w = dy[b, t], wt[j]
                    for c in range(C):
                        row[c] += w[c] * g[c]


@numba.njit(nogil=True, cache=True)
def rglru_backward(dxin, dla, m, gi, gr, u, one_minus, e2, csp, consts, reset, du, dpi, dpr):
    """The RG-LRU's element-wise backward (:meth:`qkv.nn.RGLRU.backward`) in one pass over
    ``(B, T, L)``, each product in the NumPy path's order and without contraction, so the
    bits are NumPy's: ``du = dxin m gi``; the input gate's ``dpi = dgi gi (1 - gi)`` with
    ``dgi = dxin m u``; ``dm = dxin gi u`` (0 at a reset position 0), ``dla -= (dm / sqrt(max(4 (1 -
    a²), lim))) 2 e2`` in place (``e2 = a²``, NumPy's exp); the recurrent gate's ``dpr = dla csp
    gr (1 - gr)`` with ``csp = -c softplus(Λ)``. ``consts = [1, 2, 4, lim, 0]`` in the arrays' dtype."""
    wide_vectors()
    B, T, L = dxin.shape
    one, two, four, lim, zero = consts[0], consts[1], consts[2], consts[3], consts[4]
    for b in range(B):
        for t in range(T):
            for j in range(L):
                x, mm, i, uu, r = dxin[b, t, j], m[b, t, j], gi[b, t, j], u[b, t, j], gr[b, t, j]
                xm = x * mm
                du[b, t, j] = xm * i
                dpi[b, t, j] = xm * uu * i * (one - i)
                dm = x * i * uu
                if reset and t == 0:
                    dm = zero
                v = four * one_minus[b, t, j]
                if v < lim:
                    v = lim
                g = dla[b, t, j] - dm / np.sqrt(v) * two * e2[b, t, j]
                dla[b, t, j] = g
                dpr[b, t, j] = g * csp[j] * r * (one - r)
