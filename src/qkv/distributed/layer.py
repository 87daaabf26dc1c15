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

from ..nn.base import merge_heads, split_heads
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
    ``sum_grads=False`` leaves each rank's gradients its own tokens' part, for a caller that
    sums every layer's gradients at once (:mod:`qkv.distributed.train`: one Allreduce a step).
    """

    def __init__(self, d_model: int, n_heads: int, *, comm=None, layout: str = "zigzag", sum_grads: bool = True,
                 **kwargs):
        super().__init__(d_model, n_heads, **kwargs)
        self.comm, self.size, self.rank = world(comm)
        self.layout = check_layout(layout)
        self.sum_grads = bool(sum_grads)

    def _ring_options(self, kv_lengths) -> dict:
        """The base's options of qkv.attention (one list for both layers), less the two the
        ring does not take (``q_lengths``: no padded query rows here; ``method``: the ring
        runs the tiled kernel), plus the communicator and the layout."""
        opts = self._options(kv_lengths)
        del opts["q_lengths"], opts["method"]
        return dict(opts, comm=self.comm, layout=self.layout)

    def forward(self, x, *, kv_lengths=None):
        """This rank's ``y (B, c, d_model)`` from its tokens ``x (B, c, d_model)``;
        ``kv_lengths (B,)`` are global lengths (keys at global positions past them are padding)."""
        x3, squeezed = self._input("x", x)
        pos = positions(x3.shape[1] * self.size, comm=self.comm, layout=self.layout) if self.rope else None
        q, k, v = self._heads(x3, x3)                  # (B, Hq, c, D), (B, Hkv, c, D), (B, Hkv, c, D)
        if self.rope:
            q = rope(q, pos, base=self.rope_base)       # global positions
            k = rope(k, pos, base=self.rope_base)
        opts = self._ring_options(kv_lengths)
        out, lse = ring_attention(q, k, v, return_lse=True, **opts)  # (B, Hq, c, D), (B, Hq, c)
        y = self.o_proj.forward(merge_heads(out))       # (B,c,Hq*D) @ (Hq*D,d_model) -> (B,c,d_model)
        self._keep(dict(shape=x3.shape, squeezed=squeezed, q=q, k=k, v=v, out=out, lse=lse, opts=opts, pos=pos))
        return self._output(y, None, squeezed, False)

    def backward(self, dy):
        """Fill ``grads`` (summed over ranks) from this rank's ``dy (B, c, d_model)``; return ``dx``."""
        s = self._need_saved()
        dy = self._grad_sequences(dy, s["shape"], s["squeezed"])
        do = split_heads(self.o_proj.backward(dy), self.n_heads)  # (B,c,d_model) -> (B,Hq,c,D)
        dq, dk, dv = ring_attention_backward(do, s["q"], s["k"], s["v"], s["out"], s["lse"], **s["opts"])
        if self.rope:
            dq = rope_backward(dq, s["pos"], base=self.rope_base)
            dk = rope_backward(dk, s["pos"], base=self.rope_base)
        dx = self._heads_backward(dq, dk, dv, cross=False, squeezed=s["squeezed"])  # (B, c, d_model): x fed all three
        g = self.grads if self.sum_grads else {}
        for name in sorted(g):  # token sums over the whole sequence: add every rank's part
            total = np.empty_like(g[name])
            self.comm.Allreduce(np.ascontiguousarray(g[name]), total)
            g[name][...] = total
        return dx
