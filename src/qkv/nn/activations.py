"""The feed-forward's activations with their derivatives: GELU (exact and tanh), SiLU, and erf.

Each ``*_forward(h)`` returns ``(y, saved)`` and each ``*_backward(dy, saved)`` returns
``dh``; they compute in ``h``'s dtype (float32 stays float32, as PyTorch does)::

    gelu(h)      = h Φ(h) = h (1 + erf(h / √2)) / 2          gelu'(h) = Φ(h) + h φ(h)
    gelu_tanh(h) = h (1 + tanh(u)) / 2,  u = √(2/π) (h + 0.044715 h³)
                   gelu_tanh'(h) = (1 + t) / 2 + h (1 - t²) √(2/π) (1 + 3 · 0.044715 h²) / 2,  t = tanh(u)
    silu(a)      = a σ(a)                                      silu'(a) = σ(a) (1 + a (1 - σ(a)))

``φ(h) = exp(-h²/2) / √(2π)`` is the normal density. NumPy has no ``erf``; :func:`erf` is
accurate to about 1e-15 relative (a few float64 ulp): for ``|x| < 2.5`` the series of positive terms
``erf(x) = 2/√π · e^{-x²} Σ_n x (2x²)ⁿ / (1·3·5···(2n+1))`` (no cancellation), beyond it
Laplace's continued fraction ``erfc(x) = e^{-x²}/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))``.
Both are fixed-length loops over the whole array: exact, but some 70 passes, so the exact
GELU costs more than the tanh one (GPT-2's, the default of :class:`qkv.models.GPT`).
Where the ``fast`` extra (numba) is installed, the exact GELU and both backward passes run
fused (:mod:`qkv.nn.fused`).
"""
from __future__ import annotations

import math

import numpy as np

from .fusion import compiled, module, passes

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
SERIES_TERMS = 40       # |x| < 2.5: the series' terms fall below 1e-17 of the sum by then
FRACTION_DEPTH = 30     # |x| >= 2.5: the continued fraction has converged to float64 by then


def erf(x) -> np.ndarray:
    """The error function, elementwise, in float64 (float32 for float32 and float16 input).

    >>> import math
    >>> xs = np.linspace(-6, 6, 97)
    >>> bool(np.max(np.abs(erf(xs) - [math.erf(v) for v in xs])) < 2e-15)
    True
    """
    x = np.asarray(x)
    a = np.abs(x.astype(np.float64))
    out = np.empty_like(a)
    near = a < 2.5
    s = a[near]
    two_s2 = 2.0 * s * s
    term, total = s.copy(), s.copy()
    for n in range(SERIES_TERMS):                 # term_n = x (2x²)ⁿ / (2n+1)!!
        term *= two_s2 / (2 * n + 3)
        total += term
    out[near] = (2.0 / math.sqrt(math.pi)) * np.exp(-s * s) * total
    b = a[~near]
    f = b.copy()
    for k in range(FRACTION_DEPTH, 0, -1):        # evaluated from the bottom up
        f = b + (k / 2.0) / f
    out[~near] = 1.0 - np.exp(-b * b) / (math.sqrt(math.pi) * f)
    out = np.copysign(out, x)
    return out.astype(x.dtype if x.dtype.kind == "f" and x.dtype != np.float16 else np.float64, copy=False)


# --- GELU, exact -------------------------------------------------------------------------
def gelu_forward(h: np.ndarray):
    """``h Φ(h)``; saves ``(h, Φ(h))``."""
    fast = compiled(h)
    if fast is not None:
        y, cdf = np.empty_like(h), np.empty_like(h)
        hf, yf, cf = h.reshape(-1), y.reshape(-1), cdf.reshape(-1)
        if h.dtype == np.float32:   # Φ by a vectorised erfc (qkv.nn.fused), not a scalar erf an element
            passes(fast.gelu_forward32, fast.gelu_forward32_parts, hf, yf, cf)
        else:
            fast.gelu_forward(hf, yf, cf)
        return y, (h, cdf)
    cdf = erf(h * (1.0 / math.sqrt(2.0)))
    cdf += 1.0
    cdf *= 0.5                                    # Φ(h) = (1 + erf(h/√2)) / 2
    return h * cdf, (h, cdf)


def gelu_backward(dy: np.ndarray, saved) -> np.ndarray:
    """``dy (Φ(h) + h φ(h))``."""
    h, cdf = saved
    fast = compiled(dy, h)
    if fast is not None:
        dh = np.empty_like(h)
        df, hf, cf, dhf = dy.reshape(-1), h.reshape(-1), cdf.reshape(-1), dh.reshape(-1)
        if h.dtype == np.float32:
            passes(fast.gelu_backward32, fast.gelu_backward32_parts, df, hf, cf, dhf)
        else:
            fast.gelu_backward(df, hf, cf, dhf)
        return dh
    with np.errstate(over="ignore"):              # h² beyond the dtype: φ(h) = 0, as exp(-inf) gives
        pdf = np.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))
    pdf *= h
    pdf += cdf
    pdf *= dy
    return pdf


# --- GELU, tanh approximation (GPT-2's "gelu_new") ----------------------------------------
def gelu_tanh_forward(h: np.ndarray):
    """``h (1 + tanh(u)) / 2``; saves ``(h, tanh(u))``. (float32 with the fast extra: one
    compiled pass that saves ``(h, None)``, the backward's pass computing ``tanh(u)`` again,
    as PyTorch keeps only ``h``; else NumPy's SIMD tanh and seven passes.)"""
    fast = compiled(h) if h.dtype == np.float32 else None
    if fast is not None:
        y = np.empty_like(h)
        hf, yf = h.reshape(-1), y.reshape(-1)
        passes(fast.gelu_tanh_forward32, fast.gelu_tanh_forward32_parts, hf, yf)
        return y, (h, None)
    t = h * h
    t *= SQRT_2_OVER_PI * GELU_CUBIC
    t += SQRT_2_OVER_PI
    t *= h                                        # u = √(2/π) (h + 0.044715 h³)
    np.tanh(t, out=t)
    y = t + 1.0
    y *= h
    y *= 0.5
    return y, (h, t)


def gelu_tanh_backward(dy: np.ndarray, saved) -> np.ndarray:
    """``dy ((1 + t)/2 + h (1 - t²) √(2/π) (1 + 3 · 0.044715 h²) / 2)``."""
    h, t = saved
    fast = compiled(dy, h)
    if fast is not None and t is None:
        dh = np.empty_like(h)
        df, hf, dhf = dy.reshape(-1), h.reshape(-1), dh.reshape(-1)
        passes(fast.gelu_tanh_backward32, fast.gelu_tanh_backward32_parts, df, hf, dhf)
        return dh
    if fast is not None:
        dh = np.empty_like(h)
        fast.gelu_tanh_backward(dy.reshape(-1), h.reshape(-1), t.reshape(-1), dh.reshape(-1))
        return dh
    if t is None:  # saved by the compiled forward, the fast extra gone since (QKV_JIT toggled in one process)
        t = np.tanh(SQRT_2_OVER_PI * h * (1.0 + GELU_CUBIC * h * h)).astype(h.dtype, copy=False)
    du = h * h
    du *= 3.0 * SQRT_2_OVER_PI * GELU_CUBIC
    du += SQRT_2_OVER_PI                          # du/dh = √(2/π) (1 + 3 · 0.044715 h²)
    sech2 = t * t
    np.subtract(1.0, sech2, out=sech2)            # 1 - t²
    sech2 *= du
    sech2 *= h
    sech2 += t
    sech2 += 1.0
    sech2 *= 0.5
    sech2 *= dy
    return sech2


# --- SiLU (SwiGLU's gate) ---------------------------------------------------------------
def sigmoid(a: np.ndarray) -> np.ndarray:
    """``σ(a) = 1 / (1 + e^{-a})`` in a's dtype, never overflowing: with ``e = e^{-|a|}`` in
    (0, 1], ``σ = 1 / (1 + e)`` for ``a >= 0`` and ``e / (1 + e)`` below (the same value, and
    each side to a few ulps, small σ included). Plain ufuncs: about six times faster than
    ``exp(-logaddexp(0, -a))`` in float32, which Mamba-2's and Gated DeltaNet's forward spent
    a third of their time in. The numerator is ``max(a >= 0, e)``: 1 or e exactly (e <= 1, and
    NaN stays NaN), ``np.where(a >= 0, 1, e)``'s bits at an eighth of its cost (NumPy's
    masked selection is not vectorised: 3.8 ms against 0.5 on 2^19 float32)."""
    e = np.abs(a)
    np.negative(e, out=e)
    np.exp(e, out=e)                                   # e^{-|a|}
    sig = np.greater_equal(a, 0, out=np.empty_like(e))  # 1.0 where a >= 0, else 0.0
    np.maximum(sig, e, out=sig)
    e += 1
    sig /= e
    return sig


def silu_forward(a: np.ndarray):
    """``a σ(a)``; saves ``(a, σ(a))`` (:func:`sigmoid`, never overflowing). float32 with the fast
    extra: one compiled pass (σ by the flash kernel's ``2^x``), saving ``(a, None)``; the backward
    computes σ again in its own pass."""
    fast = module() if a.dtype == np.float32 else None
    if fast is not None:
        a = np.ascontiguousarray(a)                    # (a layer's z is a slice of its projection)
        y = np.empty_like(a)
        af, yf = a.reshape(-1), y.reshape(-1)
        passes(fast.silu_forward32, fast.silu_forward32_parts, af, yf)
        return y, (a, None)
    sig = sigmoid(a)
    return a * sig, (a, sig)


def silu_backward(dy: np.ndarray, saved) -> np.ndarray:
    """``dy σ(a) (1 + a (1 - σ(a)))``."""
    a, sig = saved
    if sig is None:
        dy = np.ascontiguousarray(dy, dtype=a.dtype)
        fast = compiled(dy, a)
        if fast is None:        # the fast extra gone since the forward (QKV_JIT toggled in one process)
            sig = sigmoid(a)
        else:
            dh = np.empty_like(a)
            af, df, hf = a.reshape(-1), dy.reshape(-1), dh.reshape(-1)
            passes(fast.silu_backward32, fast.silu_backward32_parts, df, af, hf)
            return dh
    g = 1.0 - sig
    g *= a
    g += 1.0
    g *= sig
    g *= dy
    return g


ACTIVATIONS = {"gelu": (gelu_forward, gelu_backward),
               "gelu_tanh": (gelu_tanh_forward, gelu_tanh_backward)}
