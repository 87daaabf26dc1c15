"""A multi-head attention layer that runs sequence-parallel over an MPI communicator.

Each rank holds its tokens ``x (B, c, d_model)`` of a sequence of ``T = W·c`` tokens (from
:func:`qkv.distributed.shard`). The projections are per token, so each rank projects its
own tokens; RoPE rotates q and k at their *global* positions
(:func:`qkv.distributed.positions`); attention is :func:`qkv.distributed.ring_attention`.
The backward is the same in reverse, and the parameter gradients (sums over tokens) are
summed over the ranks (``Allreduce``), so every rank holds the whole sequence's gradients
and an optimizer step keeps the parameters identical everywhere.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape
from ..nn.base import check_input, merge_heads, split_heads, linear_grad
from ..nn.multihead import MultiHeadAttention
from ..positional import rope, rope_backward
from .layout import check_layout, positions, world
from .ring import ring_attention, ring_attention_backward


class RingMultiHeadAttention(MultiHeadAttention):
    """:class:`qkv.nn.MultiHeadAttention` (self-attention) over a sequence split across ranks.

    Same arguments as the single-process layer, plus ``comm`` (default ``MPI.COMM_WORLD``)
    and ``layout`` (``"zigzag"`` or ``"contiguous"``). Build it with the same ``rng`` seed on
    every rank so the parameters agree. No KV cache, cross-attention or weights: those are
    single-process features. With the same parameters, ``forward(shard(x))`` is
    ``shard(MultiHeadAttention.forward(x))`` and the gradients are the whole sequence's.
    """

    def __init__(self, d_model: int, n_heads: int, *, comm=None, layout: str = "zigzag", **kwargs):
        super().__init__(d_model, n_heads, **kwargs)
        self.comm, self.size, self.rank = world(comm)
        self.layout = check_layout(layout)

    def _ring_options(self, kv_lengths) -> dict:
        return dict(comm=self.comm, layout=self.layout, causal=self.causal, window=self.window,
                    kv_lengths=kv_lengths, alibi=self.alibi, scale=self.scale, gqa=True)

    def forward(self, x, *, kv_lengths=None):
        """This rank's ``y (B, c, d_model)`` from its tokens ``x (B, c, d_model)``;
        ``kv_lengths (B,)`` are global lengths (keys at global positions past them are padding)."""
        x3, squeezed = check_input("x", x, self.d_model)
        x3 = x3.astype(self.dtype, copy=False)
        pos = positions(x3.shape[1] * self.size, comm=self.comm, layout=self.layout) if self.rope else None
        q = self._project(x3, "Q", self.n_heads)        # (B, Hq, c, D)
        k = self._project(x3, "K", self.n_kv_heads)     # (B, Hkv, c, D)
        v = self._project(x3, "V", self.n_kv_heads)     # (B, Hkv, c, D)
        if self.rope:
            q = rope(q, pos, base=self.rope_base)       # global positions
            k = rope(k, pos, base=self.rope_base)
        opts = self._ring_options(kv_lengths)
        out, lse = ring_attention(q, k, v, return_lse=True, **opts)  # (B, Hq, c, D), (B, Hq, c)
        o = merge_heads(out)                            # (B, c, Hq*D)
        y = o @ self.params["W_O"]                      # (B, c, Hq*D) @ (Hq*D, d_model) -> (B, c, d_model)
        if self.bias:
            y = y + self.params["b_O"]
        self._saved = dict(x=x3, squeezed=squeezed, q=q, k=k, v=v, out=out, lse=lse, o=o, opts=opts, pos=pos)
        return y[0] if squeezed else y

    def backward(self, dy):
        """Fill ``grads`` (summed over ranks) from this rank's ``dy (B, c, d_model)``; return ``dx``."""
        s = self._need_saved()
        dy = as_float_array("dy", dy)
        want = s["x"].shape[1:] if s["squeezed"] else s["x"].shape
        if dy.shape != want:
            raise ShapeError(f"dy must have the output's shape (B, c, d_model) = {fmt_shape(want)}; got {fmt_shape(dy.shape)}")
        dy = (dy[None] if s["squeezed"] else dy).astype(self.dtype, copy=False)
        p, g = self.params, self.grads
        g["W_O"][...] = linear_grad(s["o"], dy)
        if self.bias:
            g["b_O"][...] = dy.sum(axis=(0, 1))
        do = split_heads(dy @ p["W_O"].T, self.n_heads)  # (B,c,d_model) @ (d_model,Hq*D) -> (B,Hq,c,D)
        dq, dk, dv = ring_attention_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], **s["opts"])
        if self.rope:
            dq = rope_backward(dq, s["pos"], base=self.rope_base)
            dk = rope_backward(dk, s["pos"], base=self.rope_base)
        dx = (self._project_backward("Q", s["x"], merge_heads(dq))
              + self._project_backward("K", s["x"], merge_heads(dk))
              + self._project_backward("V", s["x"], merge_heads(dv)))
        for name in sorted(g):  # token sums over the whole sequence: add every rank's part
            total = np.empty_like(g[name])
            self.comm.Allreduce(np.ascontiguousarray(g[name]), total)
            g[name][...] = total
        return dx[0] if s["squeezed"] else dx
