"""Multi-head latent attention (MLA), as in DeepSeek-V2 and DeepSeek-V3.

Keys and values of all heads come up from one shared low-rank latent, and the latent is
what the KV cache stores. For ``x (B, T, d_model)``, H heads of size D, a latent of size
``d_c`` and a decoupled RoPE part of size ``d_r``::

    c      = x W_DKV                       (B, T, d_c)       the cached latent
    k_C    = split(c W_UK)                 (B, H, T, D)      keys, up from the latent
    v      = split(c W_UV)                 (B, H, T, D)      values, up from the latent
    q_C    = split(x W_Q)                  (B, H, T, D)
    q_R    = rope(split(x W_QR))           (B, H, T, d_r)    per-head RoPE query
    k_R    = rope(x W_KR)                  (B, 1, T, d_r)    ONE RoPE key shared by all heads
    q, k   = [q_C ; q_R], [k_C ; k_R]      (B, H, T, D + d_r)
    o      = attention(q, k, v, scale = 1/sqrt(D + d_r))
    y      = merge(o) W_O                  (B, T, d_model)

Why the RoPE part is *decoupled*: RoPE rotates k by its position, which would sit between
``c`` and ``W_UK`` and stop the up-projection from being absorbed into the query (below).
So the rotated part is a separate small key ``k_R``, stored next to the latent.

**Decoding with the cache (the absorption trick).** ``q_C · k_C = q_C · (c W_UK,h) =
(q_C W_UK,hᵀ) · c``: fold ``W_UK`` into the query and every head attends directly to the
cached latent, as one shared kv head (MQA over ``[c ; k_R]``). Likewise
``P (c W_UV,h) = (P c) W_UV,h``: attend over ``c`` as the values, then up-project. The cache
holds ``d_c + d_r`` numbers per token, whatever H is. The full (training) pass uses the
expanded form; both are the same function, and the tests hold them to each other.

DeepSeek-V2 also compresses the queries through a latent and normalises the latent
(RMSNorm); here queries come straight from x (as in DeepSeek-V2-Lite) and there is no norm.
"""
from __future__ import annotations

import math

import numpy as np

from ..api import attention, attention_backward
from ..errors import ShapeError, as_float_array, fmt_shape, positive_int
from ..masks import parse_causal, parse_window
from ..positional import _check_base, rope, rope_backward
from .base import Layer, check_input, head_width, linear_grad, merge_heads, split_heads
from .cache import LatentCache


class LatentAttention(Layer):
    """DeepSeek's multi-head latent attention; the cache stores the latent and k_R.

    Parameters::

        W_Q   (d_model, H * D)      W_DKV (d_model, d_latent)     W_O (H * D, d_model)
        W_UK  (d_latent, H * D)     W_UV  (d_latent, H * D)
        W_QR  (d_model, H * d_rope) W_KR  (d_model, d_rope)       (only with d_rope > 0)

    Args:
        d_model, n_heads: width and heads; ``d_head`` defaults to ``d_model // n_heads``.
        d_latent: size of the shared latent ``c`` (DeepSeek-V2: 4 · d_head).
        d_rope: size of the decoupled RoPE query/key per head; default ``d_head // 2``
            rounded down to even (DeepSeek-V2: 64 with d_head 128); 0 disables RoPE.
        causal, window: as in :func:`qkv.attention`; a cache needs ``causal``.
    """

    def __init__(self, d_model: int, n_heads: int, d_latent: int, *, d_head: int | None = None,
                 d_rope: int | None = None, causal=False, window=None, rope_base: float = 10000.0,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        self.n_heads = positive_int("n_heads", n_heads)
        self.d_latent = positive_int("d_latent", d_latent)
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        self.d_rope = 2 * (self.d_head // 4) if d_rope is None else positive_int("d_rope", d_rope, 0)
        if self.d_rope % 2:
            raise ShapeError(f"d_rope must be even (RoPE rotates pairs); got {self.d_rope}")
        if self.d_rope:
            _check_base(rope_base, "rope_base")
        parse_causal(causal)
        parse_window(window)
        self.causal, self.window, self.rope_base = causal, window, rope_base
        self.scale = 1.0 / math.sqrt(self.d_head + self.d_rope)
        h, dh, dr, dc = self.n_heads, self.d_head, self.d_rope, self.d_latent
        self._add("W_Q", (self.d_model, h * dh))
        self._add("W_DKV", (self.d_model, dc))
        self._add("W_UK", (dc, h * dh))
        self._add("W_UV", (dc, h * dh))
        self._add("W_O", (h * dh, self.d_model))
        if dr:
            self._add("W_QR", (self.d_model, h * dr))
            self._add("W_KR", (self.d_model, dr))

    # --- cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        """An empty :class:`LatentCache` (latent and RoPE key) for ``batch`` x ``max_len`` tokens."""
        return LatentCache(batch, max_len, self.d_latent, self.d_rope, self.dtype)

    def cache_bytes_per_token(self) -> int:
        """Bytes the cache stores per token: ``(d_latent + d_rope) * itemsize``."""
        return (self.d_latent + self.d_rope) * self.dtype.itemsize

    # --- forward -------------------------------------------------------------------------
    def _options(self, kv_lengths, cached: bool) -> dict:
        causal = "bottom_right" if (cached and self.causal) else self.causal
        return dict(causal=causal, window=self.window, kv_lengths=kv_lengths, scale=self.scale,
                    gqa=True, method="auto")

    def _queries(self, x, start: int):
        p = self.params
        q_c = split_heads(x @ p["W_Q"], self.n_heads)  # (B,T,d_model) @ (d_model,H*D) -> (B,H,T,D)
        q_r = k_r = None
        if self.d_rope:
            q_r = rope(split_heads(x @ p["W_QR"], self.n_heads), offset=start, base=self.rope_base)  # (B,H,T,dr)
            k_r = rope((x @ p["W_KR"])[:, None], offset=start, base=self.rope_base)  # (B,1,T,dr)
        return q_c, q_r, k_r

    def forward(self, x, *, kv_lengths=None, cache: LatentCache | None = None,
                return_weights: bool = False):
        """Self-attention of ``x (B, T, d_model)`` (or ``(T, d_model)``) -> ``y`` of the same shape.

        With ``cache`` (from :meth:`new_cache`; needs ``causal``) the new tokens' latents
        are appended and the queries attend to the whole cache through the absorbed
        weights, bottom-right aligned; a full cache raises :class:`~qkv.ShapeError`.
        ``weights (B, H, T, Tk)`` are returned if asked.
        """
        x3, squeezed = check_input("x", x, self.d_model)
        x3 = x3.astype(self.dtype, copy=False)
        if cache is not None:
            if not isinstance(cache, LatentCache):
                raise ShapeError(f"cache must come from this layer's new_cache(batch, max_len); got {type(cache).__name__}")
            if not self.causal:
                raise ShapeError("cache= needs a causal layer (causal=True): a bidirectional layer cannot decode "
                                 "one token at a time")
            y, w = self._decode(x3, cache, kv_lengths, return_weights)
        else:
            y, w = self._full(x3, kv_lengths, return_weights)
        self._saved["squeezed"] = squeezed
        if squeezed:
            y, w = y[0], (None if w is None else w[0])
        return (y, w) if return_weights else y

    def _full(self, x, kv_lengths, return_weights):
        p, h = self.params, self.n_heads
        q_c, q_r, k_r = self._queries(x, 0)
        c = x @ p["W_DKV"]  # (B,T,d_model) @ (d_model,d_c) -> (B,T,d_c)
        k_c = split_heads(c @ p["W_UK"], h)  # (B,T,d_c) @ (d_c,H*D) -> (B,H,T,D)
        v = split_heads(c @ p["W_UV"], h)  # (B,T,d_c) @ (d_c,H*D) -> (B,H,T,D)
        if self.d_rope:
            q = np.concatenate([q_c, q_r], axis=-1)  # (B,H,T,D+dr)
            k = np.concatenate([k_c, np.broadcast_to(k_r, k_c.shape[:-1] + (self.d_rope,))], axis=-1)
        else:
            q, k = q_c, k_c
        opts = self._options(kv_lengths, False)
        res = attention(q, k, v, return_lse=True, return_weights=return_weights, **opts)
        out, lse = res[0], res[1]  # (B,H,T,D), (B,H,T)
        o = merge_heads(out)  # (B,T,H*D)
        y = o @ p["W_O"]  # (B,T,H*D) @ (H*D,d_model) -> (B,T,d_model)
        self._saved = dict(x=x, c=c, q=q, k=k, v=v, out=out, lse=lse, o=o, opts=opts, cached=False)
        return y, (res[2] if return_weights else None)

    def _decode(self, x, cache: LatentCache, kv_lengths, return_weights):
        p, h, dh, dc = self.params, self.n_heads, self.d_head, self.d_latent
        start = cache.length
        q_c, q_r, k_r = self._queries(x, start)
        c = (x @ p["W_DKV"])[:, None]  # (B,1,T,d_c)
        new = c if not self.d_rope else np.concatenate([c, k_r], axis=-1)  # (B,1,T,d_c+dr)
        latent = cache.write(latent=new)["latent"]  # (B,1,Tk,d_c+dr)
        w_uk = p["W_UK"].reshape(dc, h, dh)
        q_abs = np.einsum("bhtd,chd->bhtc", q_c, w_uk)  # (B,H,T,D) x (d_c,H,D) -> (B,H,T,d_c)
        q = q_abs if not self.d_rope else np.concatenate([q_abs, q_r], axis=-1)  # (B,H,T,d_c+dr)
        opts = self._options(kv_lengths, True)
        res = attention(q, latent, latent[..., :dc], return_weights=return_weights, **opts)
        out_lat = res[0] if return_weights else res  # (B,H,T,d_c): attention-weighted latents
        cache.advance(x.shape[1])
        out = np.einsum("bhtc,chd->bhtd", out_lat, p["W_UV"].reshape(dc, h, dh))  # -> (B,H,T,D)
        y = merge_heads(out) @ p["W_O"]  # (B,T,H*D) @ (H*D,d_model) -> (B,T,d_model)
        self._saved = dict(cached=True)
        return y, (res[1] if return_weights else None)

    # --- backward ------------------------------------------------------------------------
    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``. Needs an uncached forward."""
        s = self._need_saved()
        if s["cached"]:
            raise RuntimeError("LatentAttention.backward follows a forward without cache= (the cached "
                               "decoding path is inference only)")
        p, g, h, dh = self.params, self.grads, self.n_heads, self.d_head
        x, squeezed = s["x"], s["squeezed"]
        dy = as_float_array("dy", dy)
        want = x.shape[1:] if squeezed else x.shape
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (B, T, d_model) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        dy = (dy[None] if squeezed else dy).astype(self.dtype, copy=False)
        g["W_O"][...] = linear_grad(s["o"], dy)
        do = split_heads(dy @ p["W_O"].T, h)  # (B,T,d_model) @ (d_model,H*D) -> (B,H,T,D)
        dq, dk, dv = attention_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], **s["opts"])
        dq_c, dk_c = merge_heads(dq[..., :dh]), merge_heads(dk[..., :dh])  # (B,T,H*D)
        dv = merge_heads(dv)  # (B,T,H*D)
        g["W_Q"][...] = linear_grad(x, dq_c)
        dx = dq_c @ p["W_Q"].T  # (B,T,H*D) @ (H*D,d_model) -> (B,T,d_model)
        if self.d_rope:
            dq_r = merge_heads(rope_backward(dq[..., dh:], base=self.rope_base))  # (B,T,H*dr)
            dk_r = rope_backward(dk[..., dh:].sum(axis=1), base=self.rope_base)  # k_R shared: sum heads -> (B,T,dr)
            g["W_QR"][...] = linear_grad(x, dq_r)
            g["W_KR"][...] = linear_grad(x, dk_r)
            dx += dq_r @ p["W_QR"].T + dk_r @ p["W_KR"].T  # (B,T,H*dr) @ (H*dr,d_model), (B,T,dr) @ (dr,d_model)
        g["W_UK"][...] = linear_grad(s["c"], dk_c)
        g["W_UV"][...] = linear_grad(s["c"], dv)
        dc = dk_c @ p["W_UK"].T + dv @ p["W_UV"].T  # (B,T,H*D) @ (H*D,d_c) -> (B,T,d_c)
        g["W_DKV"][...] = linear_grad(x, dc)
        dx += dc @ p["W_DKV"].T  # (B,T,d_c) @ (d_c,d_model) -> (B,T,d_model)
        return dx[0] if squeezed else dx
