"""Linear attention as a trainable layer: multi-head (MHA/GQA/MQA), self or cross, with a
recurrent decoding state of constant size.

Forward, for ``x (B, T, d_model)`` and the key/value source ``s`` (``x`` itself, or the
cross-attention ``context (B, Tc, d_model)``)::

    q = split(x W_Q + b_Q)                    (B, Hq,  T,  D)
    k = split(s W_K + b_K)                    (B, Hkv, Tk, D)
    v = split(s W_V + b_V)                    (B, Hkv, Tk, D)
    o = linear_attention(q, k, v, gqa)        (B, Hq,  T,  D)   φ(x) = elu(x) + 1, no scaling
    y = merge(o) W_O + b_O                    (B, T, d_model)

**Decoding.** A causal layer can run one token at a time through a state instead of a
cache: ``S = Σ_j φ(k_j)ᵀ [v_j | 1]`` per kv head, ``(D, D + 1)`` numbers whatever the
number of tokens seen (a KV cache stores ``2·D`` more per token). ``new_state(batch)``
makes an empty one; ``forward(x_new, state=state)`` lets the new tokens see everything the
state holds and adds them to it. The state is a compensated sum, so a long decode in
float32 stays as accurate as the full pass.

Backward runs the steps in reverse as in :class:`~qkv.nn.MultiHeadAttention`, with
:func:`qkv.linear_attention_backward`'s products; after a forward with a state the tokens
the state held before are constants.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, fmt_shape, positive_int
from ..kernels import linear
from ..masks import parse_causal
from .base import Layer, check_input, head_width, linear_grad, merge_heads, split_heads


class LinearState:
    """What a causal :class:`LinearAttention` keeps between decoding calls.

    ``s`` and ``comp`` ``(B, Hkv, 1, D, D + 1)``: the compensated sum
    ``Σ_j φ(k_j)ᵀ [v_j | 1]`` over the ``length`` tokens seen (its value is ``s - comp``).
    """

    def __init__(self, batch: int, n_kv_heads: int, d_head: int, dtype):
        shape = (positive_int("batch", batch), n_kv_heads, 1, d_head, d_head + 1)
        self.s, self.comp = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.s.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held, the same after 1 token or a million."""
        return int(self.s.nbytes + self.comp.nbytes)

    def reset(self) -> None:
        """Forget every token seen."""
        self.s[...] = 0
        self.comp[...] = 0
        self.length = 0

    def __repr__(self) -> str:
        return f"LinearState({self.length} tokens, {self.s.shape}, {self.nbytes} bytes)"


class LinearAttention(Layer):
    """Multi-head linear attention with ``n_heads`` query heads and ``n_kv_heads`` kv heads.

    Parameters (projections are ``x @ W + b``), the same names and shapes as
    :class:`~qkv.nn.MultiHeadAttention`, drawn from ``rng`` in the same order::

        W_Q (d_model, n_heads * d_head)      b_Q (n_heads * d_head,)
        W_K (d_model, n_kv_heads * d_head)   b_K (n_kv_heads * d_head,)
        W_V (d_model, n_kv_heads * d_head)   b_V (n_kv_heads * d_head,)
        W_O (n_heads * d_head, d_model)      b_O (d_model,)          biases only with bias=True

    ``causal`` as in :func:`qkv.linear_attention` (needed for ``state=``). Query heads
    ``h*G .. h*G+G-1`` share kv head h. float16 layers compute in float32.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 d_head: int | None = None, causal=False, bias: bool = False,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        self.n_heads = positive_int("n_heads", n_heads)
        self.n_kv_heads = self.n_heads if n_kv_heads is None else positive_int("n_kv_heads", n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ShapeError(f"n_heads must be a multiple of n_kv_heads; got n_heads = {n_heads}, "
                             f"n_kv_heads = {n_kv_heads}")
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        parse_causal(causal)
        self.causal, self.bias = causal, bool(bias)
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self._add("W_Q", (self.d_model, hq))
        self._add("W_K", (self.d_model, hkv))
        self._add("W_V", (self.d_model, hkv))
        self._add("W_O", (hq, self.d_model))
        if self.bias:
            for name, n in (("b_Q", hq), ("b_K", hkv), ("b_V", hkv), ("b_O", self.d_model)):
                self._add(name, (n,), zero=True)

    # --- state ---------------------------------------------------------------------------
    def new_state(self, batch: int) -> LinearState:
        """An empty :class:`LinearState` for ``batch`` sequences (decoding needs ``causal``)."""
        return LinearState(batch, self.n_kv_heads, self.d_head, self._compute_dtype)

    @property
    def _compute_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)

    # --- forward / backward --------------------------------------------------------------
    def _project(self, x, name: str, heads: int) -> np.ndarray:
        y = x @ self.params["W_" + name]  # (B, T, d_model) @ (d_model, H*D) -> (B, T, H*D)
        if self.bias:
            y = y + self.params["b_" + name]
        return split_heads(y, heads).astype(self._compute_dtype, copy=False)  # (B, H, T, D)

    def _kernel_options(self, t: int, tk: int, stateful: bool) -> dict:
        align = parse_causal(self.causal)
        offset = tk - t if (align == "bottom_right" and not stateful) else 0
        return dict(causal=align is not None, offset=offset, group=self.n_heads // self.n_kv_heads)

    def _check_state(self, state, cross: bool, batch: int) -> None:
        if state is None:
            return
        if cross:
            raise ShapeError("state= is for causal self-attention decoding; got both context= and state=")
        if not isinstance(state, LinearState):
            raise ShapeError(f"state must come from this layer's new_state(batch); got {type(state).__name__}")
        if not parse_causal(self.causal):
            raise ShapeError("state= needs a causal layer (causal=True): a bidirectional layer cannot decode "
                             "one token at a time")
        want = (batch, self.n_kv_heads, 1, self.d_head, self.d_head + 1)
        if state.s.shape != want or state.s.dtype != self._compute_dtype:
            raise ShapeError(f"state must come from this layer's new_state(batch={batch}): shape {fmt_shape(want)}, "
                             f"dtype {self._compute_dtype}; got {fmt_shape(state.s.shape)}, {state.s.dtype}")

    def forward(self, x, context=None, *, state: LinearState | None = None, return_weights: bool = False):
        """Attend from ``x (B, T, d_model)`` to itself, or to ``context (B, Tc, d_model)``.

        A 2-D ``(T, d_model)`` input is one sequence. ``state``: from :meth:`new_state`;
        the new tokens see every token the state holds and are added to it.
        ``return_weights`` (not with a state, which keeps no keys) also returns the
        weights ``(B, n_heads, T, Tk)`` made densely, for looking at.

        Returns ``y (B, T, d_model)`` (and the weights).
        """
        x3, squeezed = check_input("x", x, self.d_model)
        x3 = x3.astype(self.dtype, copy=False)
        cross = context is not None
        src = x3
        if cross:
            src, c_squeezed = check_input("context", context, self.d_model)
            src = src.astype(self.dtype, copy=False)
            if c_squeezed != squeezed or src.shape[0] != x3.shape[0]:
                raise ShapeError(f"context must have x's batch: x {fmt_shape(np.shape(x))}, context (B, Tc, d_model) "
                                 f"with B = {x3.shape[0]}; got {fmt_shape(np.shape(context))}")
        self._check_state(state, cross, x3.shape[0])
        if return_weights and state is not None:
            raise ShapeError("return_weights needs the keys, which a state does not keep; got state= too")
        q = self._project(x3, "Q", self.n_heads)  # (B, Hq, T, D)
        k = self._project(src, "K", self.n_kv_heads)  # (B, Hkv, Tk, D)
        v = self._project(src, "V", self.n_kv_heads)  # (B, Hkv, Tk, D)
        opts = self._kernel_options(q.shape[-2], k.shape[-2], state is not None)
        before = None if state is None else (state.s.copy(), state.comp.copy())
        out, after = linear.forward(q, k, v, state=before, **opts)  # (B, Hq, T, D)
        if state is not None:
            state.s[...], state.comp[...] = after
            state.length += x3.shape[1]
        o = merge_heads(out).astype(self.dtype, copy=False)  # (B, T, Hq*D)
        y = o @ self.params["W_O"]  # (B, T, Hq*D) @ (Hq*D, d_model) -> (B, T, d_model)
        if self.bias:
            y = y + self.params["b_O"]
        self._saved = dict(x=x3, src=src, cross=cross, squeezed=squeezed, q=q, k=k, v=v, o=o,
                           opts=opts, before=before)
        if squeezed:
            y = y[0]
        if not return_weights:
            return y
        w = linear.weights(q, k, **{n: opts[n] for n in ("causal", "offset", "group")})
        return y, (w[0] if squeezed else w).astype(self.dtype, copy=False)

    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``, or ``(dx, dcontext)``."""
        s = self._need_saved()
        dy = np.asarray(dy)
        want = s["x"].shape[1:] if s["squeezed"] else s["x"].shape
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (B, T, d_model) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        dy = (dy[None] if s["squeezed"] else dy).astype(self.dtype, copy=False)
        p, g = self.params, self.grads
        g["W_O"][...] = linear_grad(s["o"], dy)
        if self.bias:
            g["b_O"][...] = dy.sum(axis=(0, 1))
        do = split_heads(dy @ p["W_O"].T, self.n_heads)  # (B,T,d_model) @ (d_model,Hq*D) -> (B,Hq,T,D)
        dq, dk, dv = linear.backward(do.astype(s["q"].dtype, copy=False), s["q"], s["k"], s["v"],
                                     state=s["before"], **s["opts"])
        dx = self._project_backward("Q", s["x"], merge_heads(dq))
        dsrc = self._project_backward("K", s["src"], merge_heads(dk)) \
            + self._project_backward("V", s["src"], merge_heads(dv))
        if s["cross"]:
            return (dx[0], dsrc[0]) if s["squeezed"] else (dx, dsrc)
        dx = dx + dsrc
        return dx[0] if s["squeezed"] else dx

    def _project_backward(self, name: str, x, dy) -> np.ndarray:
        """Grads of ``y = x W + b`` for ``x (B, T, d_model)``, ``dy (B, T, H*D)``; returns dx."""
        dy = dy.astype(self.dtype, copy=False)
        self.grads["W_" + name][...] = linear_grad(x, dy)
        if self.bias:
            self.grads["b_" + name][...] = dy.sum(axis=(0, 1))
        return dy @ self.params["W_" + name].T  # (B, T, H*D) @ (H*D, d_model) -> (B, T, d_model)
