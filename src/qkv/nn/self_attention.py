"""The texts' single-head self-attention layer, trainable: ``softmax(Q Kᵀ/√d_k) V``.

Forward, for ``x (..., T, d_model)``::

    Q = x W_Q,  K = x W_K,  V = x W_V          (..., T, d_k), (..., T, d_k), (..., T, d_v)
    y = attention(Q, K, V)                     (..., T, d_v)

Backward, from ``dy``: ``(dQ, dK, dV) = attention_backward(dy, ...)``, then each
projection's ``dW = xᵀ dQ`` (summed over all leading axes) and
``dx = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ`` (x feeds all three).
"""
from __future__ import annotations

import numpy as np

from ..api import attention, attention_backward
from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from ..masks import parse_causal
from .base import Layer, linear_grad


class SelfAttention(Layer):
    """One attention head with learned projections ``W_Q, W_K (d_model, d_k)``, ``W_V (d_model, d_v)``.

    No output projection (that is :class:`MultiHeadAttention`'s job): the output has
    width ``d_v`` (default ``d_k``). ``causal=True`` lets token i see tokens ``j <= i``.

    >>> import numpy as np
    >>> layer = SelfAttention(2, 2, dtype=np.float64)
    >>> for name in ("W_Q", "W_K", "W_V"): layer.params[name][...] = np.eye(2)
    >>> layer.forward(np.array([[1., 0.], [0., 1.], [1., 1.]])).round(3)  # the texts' §5
    array([[0.802, 0.599],
           [0.599, 0.802],
           [0.752, 0.752]])
    """

    def __init__(self, d_model: int, d_k: int, *, d_v: int | None = None, causal=False,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        self.d_k = positive_int("d_k", d_k)
        self.d_v = self.d_k if d_v is None else positive_int("d_v", d_v)
        parse_causal(causal)  # a bad value fails here, as in MultiHeadAttention, not at the first forward
        self.causal = causal
        self._add("W_Q", (self.d_model, self.d_k))
        self._add("W_K", (self.d_model, self.d_k))
        self._add("W_V", (self.d_model, self.d_v))

    def forward(self, x, return_weights: bool = False):
        """``x (..., T, d_model) -> y (..., T, d_v)`` (and weights ``(..., T, T)`` if asked).

        ``x`` is cast to the layer's dtype, so the output and the gradients have it too.
        """
        x = as_float_array("x", x)
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ShapeError(f"x must have shape (..., T, d_model) = (..., T, {self.d_model}); got {fmt_shape(x.shape)}")
        x = x.astype(self.dtype, copy=False)  # the layer's dtype, as every qkv.nn layer computes
        p = self.params
        q = x @ p["W_Q"]  # (..., T, d_model) @ (d_model, d_k) -> (..., T, d_k)
        k = x @ p["W_K"]  # (..., T, d_model) @ (d_model, d_k) -> (..., T, d_k)
        v = x @ p["W_V"]  # (..., T, d_model) @ (d_model, d_v) -> (..., T, d_v)
        res = attention(q, k, v, causal=self.causal, return_lse=True, return_weights=return_weights)
        out, lse = res[0], res[1]
        self._saved = (x, q, k, v, out, lse)
        return (out, res[2]) if return_weights else out

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (..., T, d_v)``; return ``dx (..., T, d_model)``."""
        x, q, k, v, out, lse = self._need_saved()
        dy = as_float_array("dy", dy)
        if dy.shape != out.shape:
            raise ShapeError(f"dy must have the output's shape (..., T, d_v) = {fmt_shape(out.shape)}; got {fmt_shape(dy.shape)}")
        dq, dk, dv = attention_backward(dy.astype(out.dtype, copy=False), q, k, v, out, lse, causal=self.causal)
        p, g = self.params, self.grads
        g["W_Q"][...] = linear_grad(x, dq)
        g["W_K"][...] = linear_grad(x, dk)
        g["W_V"][...] = linear_grad(x, dv)
        # (..., T, d_k) @ (d_k, d_model) -> (..., T, d_model), three times
        return dq @ p["W_Q"].T + dk @ p["W_K"].T + dv @ p["W_V"].T
