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

from ..errors import as_float_array, positive_int
from .attention_layer import AttentionLayer
from .checks import check_tokens


class SelfAttention(AttentionLayer):
    """One attention head with learned projections ``W_Q, W_K (d_model, d_k)``, ``W_V (d_model, d_v)``.

    No output projection (that is :class:`MultiHeadAttention`'s job): the output has
    width ``d_v`` (default ``d_k``). ``causal=True`` lets token i see tokens ``j <= i``.
    The projections are :class:`~qkv.nn.Linear` layers without bias (``q_proj``,
    ``k_proj``, ``v_proj``); ``params`` shows their weights as ``W_Q``, ``W_K``, ``W_V``.

    >>> import numpy as np
    >>> layer = SelfAttention(2, 2, dtype=np.float64)
    >>> for name in ("W_Q", "W_K", "W_V"): layer.params[name][...] = np.eye(2)
    >>> layer.forward(np.array([[1., 0.], [0., 1.], [1., 1.]])).round(3)  # the texts' §5
    array([[0.802, 0.599],
           [0.599, 0.802],
           [0.752, 0.752]])
    """

    grouped = False  # any leading axes (..., T, D), one head

    def __init__(self, d_model: int, d_k: int, *, d_v: int | None = None, causal=False,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(d_model, causal=causal, dtype=dtype, rng=rng)
        self.d_k = positive_int("d_k", d_k)
        self.d_v = self.d_k if d_v is None else positive_int("d_v", d_v)
        d = self.d_model
        self._linears(q_proj=("Q", d, self.d_k), k_proj=("K", d, self.d_k), v_proj=("V", d, self.d_v))

    def forward(self, x, return_weights: bool = False):
        """``x (..., T, d_model) -> y (..., T, d_v)`` (and weights ``(..., T, T)`` if asked).

        ``x`` is cast to the layer's dtype, so the output and the gradients have it too.
        """
        x = as_float_array("x", x)
        check_tokens("x", x.shape, self.d_model)
        x = x.astype(self.dtype, copy=False)  # the layer's dtype, as every qkv.nn layer computes
        q = self.q_proj.forward(x)  # (..., T, d_model) @ (d_model, d_k) -> (..., T, d_k)
        k = self.k_proj.forward(x)  # (..., T, d_model) @ (d_model, d_k) -> (..., T, d_k)
        v = self.v_proj.forward(x)  # (..., T, d_model) @ (d_model, d_v) -> (..., T, d_v)
        opts = self._options()
        out, lse, w = self._attend(q, k, v, opts, return_weights)
        self._keep((q, k, v, out, lse, opts))
        return (out, w) if return_weights else out

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (..., T, d_v)``; return ``dx (..., T, d_model)``."""
        q, k, v, out, lse, opts = self._need_saved()
        dy = self._grad_output(dy, out.shape, "(..., T, d_v)")
        dq, dk, dv = self._attend_backward(dy, q, k, v, out, lse, opts)
        # x feeds all three projections: dx = dq W_Qᵀ + dk W_Kᵀ + dv W_Vᵀ  (..., T, d_model)
        return self.q_proj.backward(dq) + self.k_proj.backward(dk) + self.v_proj.backward(dv)
