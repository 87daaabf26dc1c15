"""The plain layers a small attention model needs around its attention: Linear, Embedding."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
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
        y = x @ self.params["W"]  # (..., d_in) @ (d_in, d_out) -> (..., d_out)
        return y + self.params["b"] if self.bias else y

    def backward(self, dy) -> np.ndarray:
        """Fill grads from ``dy (..., d_out)``; return ``dx (..., d_in)``."""
        x = self._need_saved()
        dy = np.asarray(dy, dtype=self.dtype)
        want = x.shape[:-1] + (self.d_out,)
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (..., d_out) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        self.grads["W"][...] = linear_grad(x, dy)
        if self.bias:
            self.grads["b"][...] = dy.reshape(-1, self.d_out).sum(axis=0)
        return dy @ self.params["W"].T  # (..., d_out) @ (d_out, d_in) -> (..., d_in)


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
        np.add.at(g, ids.reshape(-1), dy.reshape(-1, self.d))
        return None
