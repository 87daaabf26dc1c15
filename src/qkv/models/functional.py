"""The non-attention pieces of a BERT layer, in float32 NumPy: LayerNorm, erf, GELU.

BERT's GELU is the exact one, ``gelu(x) = x Φ(x) = x · (1 + erf(x / √2)) / 2``. NumPy has
no ``erf`` ufunc and ``math.erf`` vectorised is ~100× too slow, so :func:`erf` uses
Abramowitz & Stegun 7.1.26::

    erf(a) ≈ 1 - (a1 t + a2 t² + a3 t³ + a4 t⁴ + a5 t⁵) exp(-a²),  t = 1 / (1 + p a),  a >= 0

with ``|error| <= 1.5e-7`` (odd symmetry for a < 0). In :func:`gelu` that bounds the error
by ``0.75e-7 · |x|`` on top of float32 rounding: about 1e-6 at ``|x| = 10``, where
``Φ(x)`` has already rounded to 0 or 1 in float32.
"""
from __future__ import annotations

import numpy as np

from .. import jit

_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, |error| <= 1.5e-7 (A&S 7.1.26); keeps x's float dtype.

    >>> import math
    >>> xs = np.linspace(-4, 4, 801)
    >>> bool(np.max(np.abs(erf(xs) - np.array([math.erf(v) for v in xs]))) < 2e-7)
    True
    """
    x = np.asarray(x)
    dt = x.dtype.type
    a = np.abs(x)
    t = 1 / (1 + dt(_P) * a)
    poly = dt(_A[4])
    for c in _A[3::-1]:
        poly = poly * t + dt(c)
    y = 1 - poly * t * np.exp(-a * a)
    return np.copysign(y, x)


CHUNK = 65536  # elements per pass of gelu: three temporaries of 256 KiB, whatever x's size


def gelu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact GELU ``x Φ(x)`` as BERT uses it (erf by A&S 7.1.26); in place when ``out is x``.

    With ``a = |x|`` and ``r = Φ(-a) = poly(t) t exp(-a²/2) / 2``, ``t = 1 / (1 + p a / √2)``:
    ``x Φ(x) = x (1 - r)`` for x >= 0 and ``x r`` for x < 0, which is ``max(x, 0) - a r``
    for both (the 1/2 is folded into the coefficients). That is about 20 elementwise passes,
    all in place in three buffers of CHUNK elements reused chunk after chunk: no allocation
    per pass, and the temporaries stay small however large x is.

    >>> from math import erf as merf, sqrt
    >>> xs = np.linspace(-6, 6, 1201, dtype=np.float32)
    >>> exact = np.array([v * (1 + merf(v / sqrt(2))) / 2 for v in xs.astype(float)])
    >>> bool(np.max(np.abs(gelu(xs) - exact)) < 1e-6)
    True
    """
    x = np.asarray(x)
    dt = x.dtype.type
    if out is None:
        out = np.empty_like(x)
    flat_x = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
    flat_out = out.reshape(-1)                    # out is ours or the caller's contiguous array
    n = flat_x.size
    step = max(1, min(n, CHUNK))
    bufs = np.empty((3, step), dtype=x.dtype)
    c_t, c_top = dt(_P / np.sqrt(2.0)), dt(_A[4] / 2)
    coef = [dt(c / 2) for c in _A[3::-1]]
    for s in range(0, n, step):
        xs, dst = flat_x[s:s + step], flat_out[s:s + step]
        a, t, r = bufs[:, :xs.size]
        np.abs(xs, out=a)
        np.multiply(a, c_t, out=t)
        t += 1
        np.reciprocal(t, out=t)                   # t = 1 / (1 + p a / √2)
        np.multiply(t, c_top, out=r)              # Horner: t (a1 + t (a2 + ... + t a5)) / 2
        for c in coef:
            r += c
            r *= t
        np.square(xs, out=t)
        t *= dt(-0.5)
        np.exp(t, out=t)
        r *= t                                    # r = Φ(-|x|)
        r *= a                                    # |x| Φ(-|x|)
        np.maximum(xs, 0, out=dst)
        dst -= r
    return out


def bias_act(h: np.ndarray, bias: np.ndarray, act: str) -> None:
    """``h = act(h + bias)`` in place for a C-contiguous float array ``h (rows, f)``. With the
    ``fast`` extra, float32 GELU is one compiled pass (:func:`qkv.models.compiled.bias_gelu`, the
    same formula as :func:`gelu`, its ``exp`` by the kernels' ``2^x``); else NumPy's passes."""
    c = jit.encoder() if act == "gelu" and h.dtype == np.float32 and h.flags.c_contiguous else None
    if c is None:
        h += bias
        ACTIVATIONS[act](h, out=h)
        return
    f = np.float32
    c.bias_gelu(h, bias.astype(f, copy=False), f(_P / np.sqrt(2.0)), *(f(a / 2) for a in _A[::-1]))


def gelu_tanh(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The tanh approximation ``x (1 + tanh(√(2/π)(x + 0.044715 x³))) / 2`` ("gelu_new")."""
    dt = x.dtype.type
    inner = x * x
    inner *= dt(0.044715)
    inner += 1
    inner *= x
    inner *= dt(np.sqrt(2 / np.pi))
    np.tanh(inner, out=inner)
    inner += 1
    inner *= dt(0.5)
    return np.multiply(x, inner, out=out)


def relu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.maximum(x, 0, out=out)


ACTIVATIONS = {"gelu": gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh,
               "gelu_fast": gelu_tanh, "relu": relu}


def add_layer_norm(x: np.ndarray, a: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """``layer_norm(x + a)`` (a residual connection, then the norm) as a new array; ``x`` may be
    changed. With the ``fast`` extra, float32 rows are one compiled pass
    (:func:`qkv.models.compiled.add_layer_norm`); else ``x += a`` and :func:`layer_norm`."""
    c = jit.encoder()
    if c is None or x.dtype != np.float32 or a.dtype != np.float32 or x.shape != a.shape:
        x += a
        return layer_norm(x, gamma, beta, eps)
    d = x.shape[-1]
    x2, a2 = np.ascontiguousarray(x).reshape(-1, d), np.ascontiguousarray(a).reshape(-1, d)
    out = np.empty_like(x2)
    c.add_layer_norm(x2, a2, gamma.astype(np.float32, copy=False), beta.astype(np.float32, copy=False),
                     np.float32(eps), out)
    return out.reshape(x.shape)


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis (biased variance)."""
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = np.einsum("...i,...i->...", xc, xc)[..., None]  # (..., d) · (..., d) -> (..., 1)
    var *= x.dtype.type(1 / x.shape[-1])
    var += x.dtype.type(eps)
    np.sqrt(var, out=var)
    xc /= var
    xc *= gamma
    xc += beta
    return xc
