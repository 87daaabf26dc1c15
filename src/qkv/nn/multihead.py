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

from ..api import attention, attention_backward
from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from ..masks import parse_causal, parse_window
from ..positional import _check_base, alibi_slopes, rope, rope_backward
from .base import Layer, check_input, head_width, linear_grad, merge_heads, split_heads
from .cache import KVCache


class MultiHeadAttention(Layer):
    """Multi-head attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads.

    Parameters (projections are ``x @ W + b``)::

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
    ``n_heads``), ``scale`` (default ``1/sqrt(d_head)``). In cross-attention the query
    positions and the context positions both count from 0 (for RoPE, ALiBi, causal and
    window alike, top-left aligned unless ``causal="bottom_right"``).

    Args:
        d_model: model width. n_heads: query heads. d_head: default ``d_model // n_heads``.
        dtype: parameter and compute dtype (inputs are cast to it). rng: a Generator.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 d_head: int | None = None, causal=False, window=None, rope: bool = False,
                 alibi: bool = False, bias: bool = False, scale: float | None = None,
                 rope_base: float = 10000.0, dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        self.n_heads = positive_int("n_heads", n_heads)
        self.n_kv_heads = self.n_heads if n_kv_heads is None else positive_int("n_kv_heads", n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ShapeError(f"n_heads must be a multiple of n_kv_heads; got n_heads = {n_heads}, "
                             f"n_kv_heads = {n_kv_heads}")
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        if rope and self.d_head % 2:
            raise ShapeError(f"rope=True needs an even d_head; got d_head = {self.d_head}")
        if rope:
            _check_base(rope_base, "rope_base")
        parse_causal(causal)
        parse_window(window)
        self.causal, self.window, self.rope, self.bias = causal, window, bool(rope), bool(bias)
        self.rope_base, self.scale = rope_base, scale
        self.alibi = alibi_slopes(self.n_heads) if alibi else None
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self._add("W_Q", (self.d_model, hq))
        self._add("W_K", (self.d_model, hkv))
        self._add("W_V", (self.d_model, hkv))
        self._add("W_O", (hq, self.d_model))
        if self.bias:
            for name, n in (("b_Q", hq), ("b_K", hkv), ("b_V", hkv), ("b_O", self.d_model)):
                self._add(name, (n,), zero=True)

    # --- cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        return KVCache(batch, self.n_kv_heads, max_len, self.d_head, self.dtype)

    def cache_bytes_per_token(self) -> int:
        """Bytes this layer's cache stores per token: ``2 * n_kv_heads * d_head * itemsize``."""
        return 2 * self.n_kv_heads * self.d_head * self.dtype.itemsize

    # --- forward / backward --------------------------------------------------------------
    def _project(self, x, name: str, heads: int) -> np.ndarray:
        y = x @ self.params["W_" + name]  # (B, T, d_model) @ (d_model, H*D) -> (B, T, H*D)
        if self.bias:
            y = y + self.params["b_" + name]
        return split_heads(y, heads)  # (B, H, T, D)

    def _options(self, kv_lengths, cached: bool) -> dict:
        causal = "bottom_right" if (cached and self.causal) else self.causal
        return dict(causal=causal, window=self.window, kv_lengths=kv_lengths, alibi=self.alibi,
                    scale=self.scale, gqa=True, method="auto")

    def forward(self, x, context=None, *, kv_lengths=None, cache: KVCache | None = None,
                return_weights: bool = False):
        """Attend from ``x (B, T, d_model)`` to itself, or to ``context (B, Tc, d_model)``.

        A 2-D ``(T, d_model)`` input is one sequence (context must then be 2-D too).
        ``kv_lengths (B,)``: keys at positions ``>= kv_lengths[b]`` (padding) are ignored.
        ``cache``: from :meth:`new_cache`; the new tokens' keys and values are appended and
        the queries attend to everything stored, bottom-right aligned, with RoPE positions
        starting at the cache length. Needs ``causal`` (a bidirectional layer cannot decode
        incrementally). A full cache raises :class:`~qkv.ShapeError` and stays unchanged.

        Returns ``y (B, T, d_model)``, and ``weights (B, n_heads, T, Tk)`` if asked.
        """
        x3, squeezed = check_input("x", x, self.d_model)
        x3 = x3.astype(self.dtype, copy=False)
        cross = context is not None
        src = x3
        if cross:
            src, c_squeezed = check_input("context", context, self.d_model)
            src = src.astype(self.dtype, copy=False)
            if c_squeezed != squeezed or src.shape[0] != x3.shape[0]:
                raise ShapeError(f"context must have x's batch: x {fmt_shape(np.shape(x))}, "
                                 f"context (B, Tc, d_model) with B = {x3.shape[0]}; got {fmt_shape(np.shape(context))}")
            if cache is not None:
                raise ShapeError("cache= is for causal self-attention decoding; got both context= and cache=")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ShapeError(f"cache must come from this layer's new_cache(batch, max_len); got {type(cache).__name__}")
            if not self.causal:
                raise ShapeError("cache= needs a causal layer (causal=True): a bidirectional layer cannot decode "
                                 "one token at a time")
        start = cache.length if cache is not None else 0
        q = self._project(x3, "Q", self.n_heads)  # (B, Hq, T, D)
        k = self._project(src, "K", self.n_kv_heads)  # (B, Hkv, Tk, D)
        v = self._project(src, "V", self.n_kv_heads)  # (B, Hkv, Tk, D)
        if self.rope:
            q = rope(q, offset=start, base=self.rope_base)
            k = rope(k, offset=start, base=self.rope_base)
        if cache is not None:
            stored = cache.write(k=k, v=v)
            k, v = stored["k"], stored["v"]  # (B, Hkv, start+T, D)
        opts = self._options(kv_lengths, cache is not None)
        res = attention(q, k, v, return_lse=True, return_weights=return_weights, **opts)
        out, lse = res[0], res[1]  # (B, Hq, T, D), (B, Hq, T)
        if cache is not None:
            cache.advance(x3.shape[1])
        o = merge_heads(out)  # (B, T, Hq*D)
        y = o @ self.params["W_O"]  # (B, T, Hq*D) @ (Hq*D, d_model) -> (B, T, d_model)
        if self.bias:
            y = y + self.params["b_O"]
        self._saved = dict(x=x3, src=src, cross=cross, squeezed=squeezed, q=q, k=k, v=v, out=out,
                           lse=lse, o=o, opts=opts, start=start)
        if squeezed:
            y = y[0]
        if return_weights:
            w = res[2]
            return y, (w[0] if squeezed else w)
        return y

    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``, or ``(dx, dcontext)``.

        After a cached forward, the keys and values stored by earlier calls are treated
        as constants: the gradients are those of this call's tokens.
        """
        s = self._need_saved()
        dy = as_float_array("dy", dy)
        want = s["x"].shape[1:] if s["squeezed"] else s["x"].shape
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (B, T, d_model) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        dy = (dy[None] if s["squeezed"] else dy).astype(self.dtype, copy=False)
        p, g = self.params, self.grads
        g["W_O"][...] = linear_grad(s["o"], dy)
        if self.bias:
            g["b_O"][...] = dy.sum(axis=(0, 1))
        do = split_heads(dy @ p["W_O"].T, self.n_heads)  # (B,T,d_model) @ (d_model,Hq*D) -> (B,Hq,T,D)
        dq, dk, dv = attention_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], **s["opts"])
        start = s["start"]
        dk, dv = dk[:, :, start:], dv[:, :, start:]  # this call's keys only (all of them without a cache)
        if self.rope:
            dq = rope_backward(dq, offset=start, base=self.rope_base)
            dk = rope_backward(dk, offset=start, base=self.rope_base)
        dx = self._project_backward("Q", s["x"], merge_heads(dq))
        dsrc = self._project_backward("K", s["src"], merge_heads(dk)) \
            + self._project_backward("V", s["src"], merge_heads(dv))
        if s["cross"]:
            return (dx[0], dsrc[0]) if s["squeezed"] else (dx, dsrc)
        dx = dx + dsrc
        return dx[0] if s["squeezed"] else dx

    def _project_backward(self, name: str, x, dy) -> np.ndarray:
        """Grads of ``y = x W + b`` for ``x (B, T, d_model)``, ``dy (B, T, H*D)``; returns dx."""
        self.grads["W_" + name][...] = linear_grad(x, dy)
        if self.bias:
            self.grads["b_" + name][...] = dy.sum(axis=(0, 1))
        return dy @ self.params["W_" + name].T  # (B, T, H*D) @ (H*D, d_model) -> (B, T, d_model)
