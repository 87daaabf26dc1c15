"""LayerNorm and RMSNorm over the last axis, with their backward.

LayerNorm (Ba et al., 2016), on each row ``x (d,)``::

    mu = mean(x),  r = 1 / sqrt(mean((x - mu)²) + eps),  x̂ = (x - mu) r,  y = x̂ ∘ weight + bias

RMSNorm (Zhang & Sennrich, 2019) drops the centring and the bias::

    r = 1 / sqrt(mean(x²) + eps),  x̂ = x r,  y = x̂ ∘ weight

Backward, with ``g = dy ∘ weight`` and means over the row (d features)::

    dweight = Σ_rows dy ∘ x̂      dbias = Σ_rows dy
    LayerNorm: dx = r (g - mean(g) - x̂ mean(g ∘ x̂))
    RMSNorm:   dx = r (g - x̂ mean(g ∘ x̂))

The variance is the biased one (divided by d), as in PyTorch. Parameters are named as in
PyTorch (``weight``, ``bias``), with the same shapes ``(d,)``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from .base import Layer
from .fusion import compiled, parallel

ROW_CHUNK = 256  # rows of one compiled LayerNorm backward call (its own column sums, added in order)


def _check(layer: Layer, x) -> np.ndarray:
    x = as_float_array("x", x)
    if x.ndim < 1 or x.shape[-1] != layer.d:
        raise ShapeError(f"x must have shape (..., d) = (..., {layer.d}); got {fmt_shape(x.shape)}")
    return x.astype(layer.dtype, copy=False)


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ShapeError(f"eps must be a number in (0, 1); got {eps!r}")
    return float(eps)


def _row_sum(a: np.ndarray) -> np.ndarray:
    """``Σ_rows a`` of ``a (..., d) -> (d,)``."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


class LayerNorm(Layer):
    """LayerNorm over the last axis of ``x (..., d)``: params ``weight (d,)`` (ones) and ``bias (d,)``
    (zeros; absent with ``bias=False``, nanoGPT's option)."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True, *, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d, self.eps, self.bias = positive_int("d", d), _check_eps(eps), bool(bias)
        self._add("weight", (self.d,), zero=True)
        self.params["weight"][...] = 1
        if self.bias:
            self._add("bias", (self.d,), zero=True)

    def forward(self, x) -> np.ndarray:
        """``(..., d) -> (..., d)``."""
        x = _check(self, x)
        w, b = self.params["weight"], self.params.get("bias")
        fast = compiled(x, w)
        if fast is not None:
            y, xhat, r = np.empty_like(x), np.empty_like(x), np.empty(x.shape[:-1], x.dtype)
            fast.layer_norm_forward(x.reshape(-1, self.d), w, np.zeros_like(w) if b is None else b,
                                    x.dtype.type(self.eps), y.reshape(-1, self.d), xhat.reshape(-1, self.d),
                                    r.reshape(-1))
            self._keep((xhat, r[..., None]))
            return y
        xc = x - x.mean(axis=-1, keepdims=True)                      # x - mu
        r = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + self.eps)  # (..., 1)
        xhat = xc
        xhat *= r                                                    # x̂ = (x - mu) r
        y = xhat * w
        if b is not None:
            y += b
        self._keep((xhat, r))
        return y

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (..., d)``; return ``dx (..., d)``."""
        xhat, r = self._need_saved()
        dy = _grad(dy, xhat, self.dtype)
        w = self.params["weight"]
        fast = compiled(dy, xhat, w)
        if fast is not None:
            dx = np.empty_like(dy)
            g, xh, rr, dx2 = dy.reshape(-1, self.d), xhat.reshape(-1, self.d), r.reshape(-1), dx.reshape(-1, self.d)
            starts = range(0, g.shape[0], ROW_CHUNK)  # fixed row chunks, whatever the threads: the same sums
            dw, db = np.zeros((len(starts), self.d)), np.zeros((len(starts), self.d))  # float64 column sums
            parallel([lambda i=i, a=a: fast.layer_norm_backward(g[a:a + ROW_CHUNK], xh[a:a + ROW_CHUNK],
                                                                 rr[a:a + ROW_CHUNK], w, dx2[a:a + ROW_CHUNK],
                                                                 dw[i], db[i]) for i, a in enumerate(starts)],
                     [min(ROW_CHUNK, g.shape[0] - a) * self.d for a in starts])
            self.grads["weight"][...] = dw.sum(axis=0)
            if self.bias:
                self.grads["bias"][...] = db.sum(axis=0)
            return dx
        self.grads["weight"][...] = _row_sum(dy * xhat)
        if self.bias:
            self.grads["bias"][...] = _row_sum(dy)
        g = dy * w                                                   # dx̂
        mean_g = g.mean(axis=-1, keepdims=True)
        mean_gx = np.mean(g * xhat, axis=-1, keepdims=True)
        g -= mean_g
        g -= xhat * mean_gx
        g *= r                                                       # r (g - mean(g) - x̂ mean(g x̂))
        return g


class RMSNorm(Layer):
    """RMSNorm over the last axis of ``x (..., d)``: param ``weight (d,)`` (ones)."""

    def __init__(self, d: int, eps: float = 1e-6, *, dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d, self.eps = positive_int("d", d), _check_eps(eps)
        self._add("weight", (self.d,), zero=True)
        self.params["weight"][...] = 1

    def forward(self, x) -> np.ndarray:
        """``(..., d) -> (..., d)``."""
        x = _check(self, x)
        r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)  # (..., 1)
        xhat = x * r
        self._keep((xhat, r))
        return xhat * self.params["weight"]

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (..., d)``; return ``dx (..., d)``."""
        xhat, r = self._need_saved()
        dy = _grad(dy, xhat, self.dtype)
        self.grads["weight"][...] = _row_sum(dy * xhat)
        g = dy * self.params["weight"]                               # dx̂
        g -= xhat * np.mean(g * xhat, axis=-1, keepdims=True)
        g *= r                                                       # r (g - x̂ mean(g x̂))
        return g


def _grad(dy, like: np.ndarray, dtype) -> np.ndarray:
    dy = as_float_array("dy", dy)
    if dy.shape != like.shape:
        raise ShapeError(f"dy must have the output's shape (..., d) = {fmt_shape(like.shape)}; "
                         f"got {fmt_shape(dy.shape)}")
    return dy.astype(dtype, copy=False)
