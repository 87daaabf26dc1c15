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

from ..errors import ShapeError, positive_int
from ..positional import rope, rope_backward
from .attention_layer import AttentionLayer
from .base import merge_heads, split_heads
from .checks import head_width
from .cache import LatentCache


class LatentAttention(AttentionLayer):
    """DeepSeek's multi-head latent attention; the cache stores the latent and k_R.

    Parameters (each the ``W`` of an :class:`~qkv.nn.Linear` without bias: ``q_proj``,
    ``kv_down``, ``k_up``, ``v_up``, ``o_proj``, ``q_rope``, ``k_rope``)::

        W_Q   (d_model, H * D)      W_DKV (d_model, d_latent)     W_O (H * D, d_model)
        W_UK  (d_latent, H * D)     W_UV  (d_latent, H * D)
        W_QR  (d_model, H * d_rope) W_KR  (d_model, d_rope)       (only with d_rope > 0)

    Args:
        d_model, n_heads: width and heads; ``d_head`` defaults to ``d_model // n_heads``.
        d_latent: size of the shared latent ``c`` (DeepSeek-V2: 4 · d_head).
        d_rope: size of the decoupled RoPE query/key per head; default ``d_head // 2``
            rounded down to even (DeepSeek-V2: 64 with d_head 128); 0 disables RoPE.
        causal, window: as in :func:`qkv.attention`; a cache needs ``causal``.
        softcap, dropout: as in :class:`MultiHeadAttention` (dropout in ``train()`` mode only).
    ``eval()`` makes the forward keep nothing for backward (inference; ``train()`` undoes it).
    """

    cache_type = LatentCache

    def __init__(self, d_model: int, n_heads: int, d_latent: int, *, d_head: int | None = None,
                 d_rope: int | None = None, causal=False, align=None, window=None, chunk=None,
                 rope_base: float = 10000.0, softcap=None, dropout: float = 0.0, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(d_model, causal=causal, align=align, window=window, chunk=chunk, softcap=softcap,
                         dropout=dropout, dtype=dtype, rng=rng)
        self.n_heads = positive_int("n_heads", n_heads)
        self.d_latent = positive_int("d_latent", d_latent)
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        self.d_rope = 2 * (self.d_head // 4) if d_rope is None else positive_int("d_rope", d_rope, 0)
        if self.d_rope % 2:
            raise ShapeError(f"d_rope must be even (RoPE rotates pairs); got {self.d_rope}")
        self._check_rope_base(self.d_rope > 0, rope_base)
        self.scale = 1.0 / math.sqrt(self.d_head + self.d_rope)
        d, hd, hr, dc = self.d_model, self.n_heads * self.d_head, self.n_heads * self.d_rope, self.d_latent
        shapes = dict(q_proj=("Q", d, hd), kv_down=("DKV", d, dc), k_up=("UK", dc, hd), v_up=("UV", dc, hd),
                      o_proj=("O", hd, d))
        if self.d_rope:
            shapes.update(q_rope=("QR", d, hr), k_rope=("KR", d, self.d_rope))
        self._linears(**shapes)

    # --- cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        """An empty :class:`LatentCache` (latent and RoPE key) for ``batch`` x ``max_len`` tokens."""
        return LatentCache(batch, max_len, self.d_latent, self.d_rope, self.dtype)

    def cache_bytes_per_token(self) -> int:
        """Bytes the cache stores per token: ``(d_latent + d_rope) * itemsize``."""
        return (self.d_latent + self.d_rope) * self.dtype.itemsize

    # --- forward -------------------------------------------------------------------------
    def _queries(self, x, start):
        q_c = split_heads(self.q_proj.forward(x), self.n_heads)  # (B,T,d_model) @ (d_model,H*D) -> (B,H,T,D)
        q_r = k_r = None
        if self.d_rope:
            q_r = rope(split_heads(self.q_rope.forward(x), self.n_heads), offset=start, base=self.rope_base)  # (B,H,T,dr)
            k_r = rope(self.k_rope.forward(x)[:, None], offset=start, base=self.rope_base)  # (B,1,T,dr)
        return q_c, q_r, k_r

    def forward(self, x, *, kv_lengths=None, q_lengths=None, cache: LatentCache | None = None,
                return_weights: bool = False):
        """Self-attention of ``x (B, T, d_model)`` (or ``(T, d_model)``) -> ``y`` of the same shape.

        ``kv_lengths``/``q_lengths (B,)``: keys/rows at or past them are padding.
        With ``cache`` (from :meth:`new_cache`; needs ``causal``) each sequence's new tokens
        (its first ``q_lengths[b]`` rows) are appended after its own stored ones and its
        queries attend to them through the absorbed weights, bottom-right aligned to its own
        length; a full cache raises :class:`~qkv.ShapeError`.
        ``weights (B, H, T, Tk)`` are returned if asked.
        """
        x3, squeezed = self._input("x", x)
        self._check_cache(cache)
        if cache is not None:
            y, w, saved = self._decode(x3, cache, kv_lengths, q_lengths, return_weights)
        else:
            y, w, saved = self._full(x3, kv_lengths, q_lengths, return_weights)
        self._keep(dict(saved, shape=x3.shape, squeezed=squeezed))
        return self._output(y, w, squeezed, return_weights)

    def _full(self, x, kv_lengths, q_lengths, return_weights):
        q_c, q_r, k_r = self._queries(x, 0)
        c = self.kv_down.forward(x)  # (B,T,d_model) @ (d_model,d_c) -> (B,T,d_c)
        k_c = split_heads(self.k_up.forward(c), self.n_heads)  # (B,T,d_c) @ (d_c,H*D) -> (B,H,T,D)
        v = split_heads(self.v_up.forward(c), self.n_heads)  # (B,T,d_c) @ (d_c,H*D) -> (B,H,T,D)
        if self.d_rope:
            q = np.concatenate([q_c, q_r], axis=-1)  # (B,H,T,D+dr)
            k = np.concatenate([k_c, np.broadcast_to(k_r, k_c.shape[:-1] + (self.d_rope,))], axis=-1)
        else:
            q, k = q_c, k_c
        opts = self._options(kv_lengths, q_lengths)
        out, lse, w = self._attend(q, k, v, opts, return_weights)  # (B,H,T,D), (B,H,T)
        y = self.o_proj.forward(merge_heads(out))  # (B,T,H*D) @ (H*D,d_model) -> (B,T,d_model)
        return y, w, dict(q=q, k=k, v=v, out=out, lse=lse, opts=opts, cached=False)

    def _decode(self, x, cache: LatentCache, kv_lengths, q_lengths, return_weights):
        p, h, dh, dc = self.params, self.n_heads, self.d_head, self.d_latent
        start, counts, kv_len, q_len = self._cache_step(cache, x.shape[1], kv_lengths, q_lengths)
        q_c, q_r, k_r = self._queries(x, start)
        c = self.kv_down.forward(x)[:, None]  # (B,1,T,d_c)
        new = c if not self.d_rope else np.concatenate([c, k_r], axis=-1)  # (B,1,T,d_c+dr)
        latent = cache.write(latent=new, counts=counts)["latent"]  # (B,1,Tk,d_c+dr)
        w_uk = p["W_UK"].reshape(dc, h, dh)
        q_abs = np.einsum("bhtd,chd->bhtc", q_c, w_uk)  # (B,H,T,D) x (d_c,H,D) -> (B,H,T,d_c)
        q = q_abs if not self.d_rope else np.concatenate([q_abs, q_r], axis=-1)  # (B,H,T,d_c+dr)
        out_lat, _, w = self._attend(q, latent, latent[..., :dc], self._options(kv_len, q_len, True),
                                     return_weights, lse=False)  # (B,H,T,d_c): attention-weighted latents
        cache.advance(counts)
        out = np.einsum("bhtc,chd->bhtd", out_lat, p["W_UV"].reshape(dc, h, dh))  # -> (B,H,T,D)
        y = self.o_proj.forward(merge_heads(out))  # (B,T,H*D) @ (H*D,d_model) -> (B,T,d_model)
        self._forget()  # decoding is inference only: the projections keep nothing for backward
        return y, w, dict(cached=True)

    # --- backward ------------------------------------------------------------------------
    def backward(self, dy):
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx``. Needs an uncached forward."""
        s = self._need_saved()
        if s["cached"]:
            raise RuntimeError("LatentAttention.backward follows a forward without cache= (the cached "
                               "decoding path is inference only)")
        dh = self.d_head
        dy = self._grad_sequences(dy, s["shape"], s["squeezed"])
        do = split_heads(self.o_proj.backward(dy), self.n_heads)  # (B,T,d_model) -> (B,T,H*D) -> (B,H,T,D)
        dq, dk, dv = self._attend_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], s["opts"])
        dx = self.q_proj.backward(merge_heads(dq[..., :dh]))  # (B,T,H*D) -> (B,T,d_model)
        if self.d_rope:
            dq_r = merge_heads(rope_backward(dq[..., dh:], base=self.rope_base))  # (B,T,H*dr)
            dk_r = rope_backward(dk[..., dh:].sum(axis=1), base=self.rope_base)  # k_R shared: sum heads -> (B,T,dr)
            dx += self.q_rope.backward(dq_r) + self.k_rope.backward(dk_r)  # (B,T,d_model)
        # c feeds W_UK and W_UV: dc = dk_C W_UKᵀ + dv W_UVᵀ  (B,T,d_c)
        dc = self.k_up.backward(merge_heads(dk[..., :dh])) + self.v_up.backward(merge_heads(dv))
        dx += self.kv_down.backward(dc)  # (B,T,d_c) @ (d_c,d_model) -> (B,T,d_model)
        return dx[0] if s["squeezed"] else dx
