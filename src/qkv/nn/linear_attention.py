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
the state held before are constants. The layer stands on the attention-layer base
(:class:`~qkv.nn.attention_layer.AttentionLayer`): options, the ``Linear`` projections
``q_proj`` … ``o_proj``, the checks of ``x``, ``context`` and ``dy``, train/eval.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, fmt_shape, positive_int
from ..kernels import linear
from ..options import parse_alignment
from .attention_layer import AttentionLayer
from .base import merge_heads, split_heads
from .checks import head_width, kv_heads


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


class LinearAttention(AttentionLayer):
    """Multi-head linear attention with ``n_heads`` query heads and ``n_kv_heads`` kv heads.

    Parameters (projections are ``x @ W + b``, each an :class:`~qkv.nn.Linear`: ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``), the same names and shapes as
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
        super().__init__(d_model, causal=causal, dtype=dtype, rng=rng)
        self.n_heads = positive_int("n_heads", n_heads)
        self.n_kv_heads = kv_heads(self.n_heads, n_kv_heads)
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        self.bias = bool(bias)
        d, hq, hkv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self._linears(bias=self.bias, q_proj=("Q", d, hq), k_proj=("K", d, hkv), v_proj=("V", d, hkv),
                      o_proj=("O", hq, d))

    # --- state ---------------------------------------------------------------------------
    def new_state(self, batch: int) -> LinearState:
        """An empty :class:`LinearState` for ``batch`` sequences (decoding needs ``causal``)."""
        return LinearState(batch, self.n_kv_heads, self.d_head, self._compute_dtype)

    @property
    def _compute_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)

    # --- forward / backward --------------------------------------------------------------
    def _kernel_options(self, t: int, tk: int, stateful: bool) -> dict:
        """Keyword arguments of the linear kernel: causal, the alignment offset, heads per kv head."""
        causal, align = parse_alignment(self.causal, self.align)
        offset = tk - t if (causal and align == "bottom_right" and not stateful) else 0
        return dict(causal=causal, offset=offset, group=self.n_heads // self.n_kv_heads)

    def _check_state(self, state, cross: bool, batch: int) -> None:
        if state is None:
            return
        if cross:
            raise ShapeError("state= is for causal self-attention decoding; got both context= and state=")
        if not isinstance(state, LinearState):
            raise ShapeError(f"state must come from this layer's new_state(batch); got {type(state).__name__}")
        if not parse_alignment(self.causal, self.align)[0]:
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
        x3, squeezed = self._input("x", x)
        cross = context is not None
        src = self._context(context, x, x3, squeezed) if cross else x3
        self._check_state(state, cross, x3.shape[0])
        if return_weights and state is not None:
            raise ShapeError("return_weights needs the keys, which a state does not keep; got state= too")
        q, k, v = (a.astype(self._compute_dtype, copy=False) for a in self._heads(x3, src))  # (B,Hq,T,D), (B,Hkv,Tk,D) x2
        opts = self._kernel_options(q.shape[-2], k.shape[-2], state is not None)
        before = None if state is None else (state.s.copy(), state.comp.copy())
        out, after = linear.forward(q, k, v, state=before, **opts)  # (B, Hq, T, D)
        if state is not None:
            state.s[...], state.comp[...] = after
            state.length += x3.shape[1]
        y = self.o_proj.forward(merge_heads(out))  # (B,T,Hq*D) @ (Hq*D,d_model) -> (B,T,d_model)
        self._keep(dict(shape=x3.shape, cross=cross, squeezed=squeezed, q=q, k=k, v=v, opts=opts, before=before))
        w = linear.weights(q, k, **opts).astype(self.dtype, copy=False) if return_weights else None
        return self._output(y, w, squeezed, return_weights)

    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``, or ``(dx, dcontext)``."""
        s = self._need_saved()
        dy = self._grad_sequences(dy, s["shape"], s["squeezed"])
        do = split_heads(self.o_proj.backward(dy), self.n_heads)  # (B,T,d_model) -> (B,T,Hq*D) -> (B,Hq,T,D)
        dq, dk, dv = linear.backward(do.astype(s["q"].dtype, copy=False), s["q"], s["k"], s["v"],
                                     state=s["before"], **s["opts"])
        return self._heads_backward(dq, dk, dv, s["cross"], s["squeezed"])
