"""The plain layers a small attention model needs around its attention: Linear, Embedding."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from . import products
from .base import Layer, linear_grad


class Linear(Layer):
    """``y = x W + b`` on ``x (..., d_in)``; params ``W (d_in, d_out)``, ``b (d_out,)`` (bias=True)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = True, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_in, self.d_out = positive_int("d_in", d_in), positive_int("d_out", d_out)
        self.bias = bool(bias)
        self._add("W", (self.d_in, self.d_out))
        if self.bias:
            self._add("b", (self.d_out,), zero=True)

    def forward(self, x) -> np.ndarray:
        """``(..., d_in) -> (..., d_out)``."""
        x = as_float_array("x", x)
        if x.ndim < 1 or x.shape[-1] != self.d_in:
            raise ShapeError(f"x must have shape (..., d_in) = (..., {self.d_in}); got {fmt_shape(x.shape)}")
        x = x.astype(self.dtype, copy=False)
        self._keep(x)
        # One 2-D product: NumPy runs a stacked (B, T, d_in) @ W as B smaller ones (~15% slower).
        y = products.matmul(x.reshape(-1, self.d_in), self.params["W"])  # (N, d_in) @ (d_in, d_out) -> (N, d_out)
        if self.bias:
            y += self.params["b"]
        return y.reshape(x.shape[:-1] + (self.d_out,))

    def backward(self, dy) -> np.ndarray:
        """Fill grads from ``dy (..., d_out)``; return ``dx (..., d_in)``."""
        x = self._need_saved()
        dy = np.asarray(dy, dtype=self.dtype)
        want = x.shape[:-1] + (self.d_out,)
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (..., d_out) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        linear_grad(x, dy, out=self.grads["W"])
        if self.bias:
            self.grads["b"][...] = dy.reshape(-1, self.d_out).sum(axis=0)
        dx = products.matmul(dy.reshape(-1, self.d_out), self.params["W"].T)  # (N, d_out) @ (d_out, d_in) -> (N, d_in)
        return dx.reshape(x.shape)


class Embedding(Layer):
    """A table ``W (n, d)``: ``forward(ids (...,)) -> W[ids] (..., d)``."""

    def __init__(self, n: int, d: int, *, std: float = 1.0, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.n, self.d = positive_int("n", n), positive_int("d", d)
        self._add("W", (self.n, self.d), std=std)

    def forward(self, ids) -> np.ndarray:
        """Rows of the table for integer ``ids`` of any shape."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ShapeError(f"ids must be an integer array; got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n):
            raise ShapeError(f"ids must lie in [0, n) = [0, {self.n}); got values from {ids.min()} to {ids.max()}")
        self._keep(ids)
        return self.params["W"][ids]

    def backward(self, dy) -> None:
        """Fill ``grads["W"]`` from ``dy (..., d)`` (rows used twice add up). Returns None."""
        ids = self._need_saved()
        dy = np.asarray(dy, dtype=self.dtype)
        want = ids.shape + (self.d,)
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (..., d) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        g = self.grads["W"]
        g[...] = 0
        flat = ids.reshape(-1)
        if flat.size:  # the rows of each id summed: sort the ids, then add up each run of equal ones
            order = np.argsort(flat, kind="stable")
            ranked = flat[order]
            starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
            g[ranked[starts]] = np.add.reduceat(dy.reshape(-1, self.d)[order], starts, axis=0)
        return None


class Dropout(Layer):
    """Inverted dropout: in training, each entry is zeroed with probability ``p`` and the rest are
    scaled by ``1 / (1 - p)``; in ``eval()`` mode (and with ``p = 0``) the identity.

    The keep-mask is drawn from ``rng`` (a ``numpy.random.Generator``) and kept for backward,
    which multiplies ``dy`` by the same scaled mask. No parameters.
    """

    def __init__(self, p: float = 0.0, rng: np.random.Generator | None = None, *, dtype=np.float32):
        super().__init__(dtype=dtype, rng=rng)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ShapeError(f"p must be a probability in [0, 1); got {p!r}")
        self.p = float(p)

    def forward(self, x) -> np.ndarray:
        """``x`` with entries dropped (training, p > 0), else ``x`` itself."""
        x = as_float_array("x", x)
        if not self.training or self.p == 0:
            self._keep(None)
            self._inference_forward = True  # nothing kept: backward passes dy through
            return x
        mask = self.rng.random(x.shape, dtype=np.float32 if x.dtype != np.float64 else np.float64) >= self.p
        scaled = mask.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))  # 0 or 1/(1-p)
        self._keep(scaled)
        return x * scaled

    def backward(self, dy) -> np.ndarray:
        """``dy`` times the forward's scaled keep-mask (``dy`` itself after an identity forward)."""
        if self._saved is None and self._inference_forward:
            return np.asarray(dy)
        scaled = self._need_saved()
        dy = np.asarray(dy)
        if dy.shape != scaled.shape:
            raise ShapeError(f"dy must have the output's shape {fmt_shape(scaled.shape)}; "
                             f"got {fmt_shape(dy.shape)}")
        return dy * scaled
