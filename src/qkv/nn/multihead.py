"""Multi-head attention: MHA, GQA and MQA, self or cross, with RoPE, ALiBi, windows and a KV cache.

Forward, for ``x (B, T, d_model)`` and the key/value source ``s`` (``x`` itself, or the
cross-attention ``context (B, Tc, d_model)``)::

    q = split(x W_Q + b_Q)          (B, Hq,  T,  D)
    k = split(s W_K + b_K)          (B, Hkv, Tk, D)
    v = split(s W_V + b_V)          (B, Hkv, Tk, D)
    q, k = rope(q), rope(k)         (optional; positions offset by the cache length)
    o = attention(q, k, v, gqa)     (B, Hq,  T,  D)   query heads h*G..h*G+G-1 share kv head h
    y = merge(o) W_O + b_O          (B, T, d_model)

K and V are never repeated for GQA: :func:`qkv.attention` takes ``gqa=True``.

Backward runs the same steps in reverse: ``dW_O = merge(o)ᵀ dy``, ``do = dy W_Oᵀ``,
``(dq, dk, dv) = attention_backward(do, ...)``, RoPE's inverse rotation on dq and dk,
then each projection ``dW = inputᵀ d(out)``, ``db = Σ d(out)`` and the input gradient
``dx = dq W_Qᵀ (+ dk W_Kᵀ + dv W_Vᵀ for self-attention)``.
"""
from __future__ import annotations

import numpy as np

from ..options import parse_window
from ..positional import alibi_slopes, rope, rope_backward
from .attention_layer import AttentionLayer
from .base import merge_heads, split_heads
from .cache import KVCache
from .checks import head_layout, keys_start, rope_options


class MultiHeadAttention(AttentionLayer):
    """Multi-head attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads.

    Parameters (projections are ``x @ W + b``, each an :class:`~qkv.nn.Linear`:
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``)::

        W_Q (d_model, n_heads * d_head)      b_Q (n_heads * d_head,)
        W_K (d_model, n_kv_heads * d_head)   b_K (n_kv_heads * d_head,)
        W_V (d_model, n_kv_heads * d_head)   b_V (n_kv_heads * d_head,)
        W_O (n_heads * d_head, d_model)      b_O (d_model,)          biases only with bias=True

    Feature ``h*d_head + i`` of a projection is feature ``i`` of head ``h``.
    ``n_kv_heads = n_heads`` (default) is MHA, ``1 < n_kv_heads < n_heads`` GQA (query
    heads ``h*G .. h*G+G-1``, ``G = n_heads // n_kv_heads``, share kv head h) and 1 MQA.

    Options: ``causal`` (as in :func:`qkv.attention`; with a cache the alignment is
    always bottom-right), ``window`` (``n`` or ``(left, right)``), ``rope`` (rotary
    embedding of q and k, half-split, ``rope_base``), ``alibi`` (the paper's slopes for
    ``n_heads``), ``scale`` (default ``1/sqrt(d_head)``), ``softcap`` (scores
    ``c·tanh(x / c)``), ``dropout`` (attention-weight dropout, in ``train()`` mode only, a
    seed a call drawn from ``rng``). In cross-attention the query
    positions and the context positions both count from 0 (for RoPE, ALiBi, causal and
    window alike, top-left aligned unless ``causal="bottom_right"``).
    ``eval()`` makes the forward keep nothing for backward (inference; ``train()`` undoes it).

    Args:
        d_model: model width. n_heads: query heads. d_head: default ``d_model // n_heads``.
        dtype: parameter and compute dtype (inputs are cast to it). rng: a Generator.
    """

    cache_type = KVCache

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 d_head: int | None = None, causal=False, align=None, window=None, chunk=None,
                 rope: bool = False, alibi: bool = False, bias: bool = False, scale: float | None = None,
                 rope_base: float = 10000.0, softcap=None, dropout: float = 0.0, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(d_model, causal=causal, align=align, window=window, chunk=chunk, scale=scale,
                         softcap=softcap, dropout=dropout, dtype=dtype, rng=rng)
        self.n_heads, self.n_kv_heads, self.d_head = head_layout(self.d_model, n_heads, n_kv_heads, d_head)
        self.rope_base = rope_options(rope, self.d_head, rope_base)
        self.rope, self.bias = bool(rope), bool(bias)
        self.alibi = alibi_slopes(self.n_heads) if alibi else None
        d, hq, hkv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self._linears(bias=self.bias, q_proj=("Q", d, hq), k_proj=("K", d, hkv), v_proj=("V", d, hkv),
                      o_proj=("O", hq, d))

    # --- cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens; a
        causal layer with ``window=W`` (and no chunk) gets one that keeps the last W keys only
        (a ring: :mod:`qkv.nn.cache`), as no later query can see the keys before them."""
        return KVCache(batch, self.n_kv_heads, max_len, self.d_head, self.dtype, window=self.kept_keys())

    def kept_keys(self) -> int | None:
        """How many keys before the newest a cache must keep: ``left`` of a causal layer's
        ``window=(left, right)``; None (every key) without a window, with an unbounded left,
        or with a chunk (its boundaries count from key 0)."""
        if not self.causal or self.window is None or self.chunk is not None:
            return None
        return parse_window(self.window)[0]

    def cache_bytes_per_token(self) -> int:
        """Bytes this layer's cache stores per token: ``2 * n_kv_heads * d_head * itemsize``."""
        return 2 * self.n_kv_heads * self.d_head * self.dtype.itemsize

    # --- forward / backward --------------------------------------------------------------
    def forward(self, x, context=None, *, kv_lengths=None, q_lengths=None, cache: KVCache | None = None,
                return_weights: bool = False):
        """Attend from ``x (B, T, d_model)`` to itself, or to ``context (B, Tc, d_model)``.

        A 2-D ``(T, d_model)`` input is one sequence (context must then be 2-D too).
        ``kv_lengths (B,)``: keys at positions ``>= kv_lengths[b]`` (padding) are ignored;
        ``q_lengths (B,)``: rows of ``x`` at positions ``>= q_lengths[b]`` are padding
        (output 0, never read).
        ``cache``: from :meth:`new_cache`; each sequence's new tokens (its first
        ``q_lengths[b]`` rows: right-padded prompts of different lengths are prefilled
        together) are appended after its own stored ones, and its queries attend to what it
        has stored, bottom-right aligned to its own length, with RoPE positions counting
        from it. Needs ``causal`` (a bidirectional layer cannot decode incrementally). A full
        cache raises :class:`~qkv.ShapeError` and stays unchanged. A windowed layer's cache
        keeps the last W keys only; its queries see the same keys as without it.

        Returns ``y (B, T, d_model)``, and ``weights (B, n_heads, T, Tk)`` if asked (with a
        cache, Tk covers the keys it holds, then the new ones).
        """
        x3, squeezed = self._input("x", x)
        cross = context is not None
        src = x3
        if cross:
            src = self._context(context, x, x3, squeezed)
        self._check_cache(cache, cross=cross)
        start, counts, kv_len, q_len = 0, None, kv_lengths, q_lengths
        if cache is not None:
            start, counts, kv_len, q_len = self._cache_step(cache, x3.shape[1], kv_lengths, q_lengths)
        q, k, v = self._heads(x3, src)  # (B, Hq, T, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D)
        if self.rope:
            q = rope(q, offset=start, base=self.rope_base)
            k = rope(k, offset=start, base=self.rope_base)
        first = kstart = 0
        if cache is not None:
            kstart = keys_start(cache)  # start, less the keys a window's cache no longer keeps
            stored = cache.write(k=k, v=v, counts=counts)
            first = 0 if return_weights else self._window_start(stored["k"].shape[2], x3.shape[1], kv_len)
            k, v = stored["k"][:, :, first:], stored["v"][:, :, first:]  # (B, Hkv, start+T-first, D)
        opts = self._options(kv_len, q_len, cache is not None)
        out, lse, w = self._attend(q, k, v, opts, return_weights)  # (B,Hq,T,D), (B,Hq,T)
        if cache is not None:
            cache.advance(counts)
        y = self.o_proj.forward(merge_heads(out))  # (B,T,Hq*D) @ (Hq*D,d_model) -> (B,T,d_model)
        self._keep(dict(shape=x3.shape, cross=cross, squeezed=squeezed, q=q, k=k, v=v, out=out, lse=lse,
                        opts=opts, start=start, kstart=kstart - first))
        return self._output(y, w, squeezed, return_weights)

    def _window_start(self, end: int, t: int, kv_len) -> int:
        """The first cached key a windowed call can see: with ``window=(left, right)`` the
        bottom-right aligned queries see no key before ``end - t - left``, so a decoding step
        reads W + 1 keys, not the whole cache. 0 (every key) without a window, with a chunk
        (its boundaries count from key 0) or for sequences of different lengths (nor when the
        weights are asked for: they cover every key)."""
        if self.window is None or self.chunk is not None or kv_len is not None:
            return 0
        left = parse_window(self.window)[0]
        return 0 if left is None else max(0, end - t - left)

    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``, or ``(dx, dcontext)``.

        After a cached forward, the keys and values stored by earlier calls are treated
        as constants: the gradients are those of this call's tokens.
        """
        s = self._need_saved()
        dy = self._grad_sequences(dy, s["shape"], s["squeezed"])
        do = split_heads(self.o_proj.backward(dy), self.n_heads)  # (B,T,d_model) -> (B,T,Hq*D) -> (B,Hq,T,D)
        dq, dk, dv = self._attend_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], s["opts"])
        start, kstart = s["start"], s["kstart"]  # kstart: where this call's keys are in the keys attended to
        t = s["shape"][1]
        dk, dv = self._new_keys(dk, kstart, t), self._new_keys(dv, kstart, t)  # this call's keys only
        if self.rope:
            dq = rope_backward(dq, offset=start, base=self.rope_base)
            dk = rope_backward(dk, offset=start, base=self.rope_base)
        return self._heads_backward(dq, dk, dv, s["cross"], s["squeezed"])
