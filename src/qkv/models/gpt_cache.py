"""A GPT's decoding cache: one entry per block, and the tokens each sequence holds.

An attention block's entry is its :class:`~qkv.nn.KVCache` (keys and values of every token,
a length per sequence); a recurrent block's is its :class:`~qkv.nn.RecurrentState` (and a
linear-attention block's its :class:`~qkv.nn.LinearState`): a fixed-size state that one
call updates for the whole batch, with no length per sequence. :class:`GPTCache` keeps the
lengths for the model (the positions of the next tokens, and the bound ``max_len``).

A right-padded batch of prompts of different lengths cannot go through a state in one call
(the padding would be folded into the shorter sequences' states), so a model with any such
block prefills each sequence alone, through :meth:`GPTCache.row`: views of sequence b's rows
of every entry (KV arrays, conv window, recurrent state), which the block updates in place.
Decoding then runs the whole batch one token a step, as for attention alone.
"""
from __future__ import annotations

import copy

import numpy as np

from ..errors import ShapeError, fmt_shape
from ..nn import Cache, ConvKVCache, LinearState, RecurrentState


class GPTCache(list):
    """``GPT.new_cache(batch, max_len)``: a list of each block's cache or state, with
    ``lengths (B,)`` (tokens held per sequence), ``length`` (the longest) and ``max_len``."""

    def __init__(self, entries, batch: int, max_len: int):
        super().__init__(entries)
        self.batch, self.max_len = batch, max_len
        self.lengths = np.zeros(batch, dtype=np.int64)

    @property
    def length(self) -> int:
        return int(self.lengths.max(initial=0))

    def counts(self, t: int, q_lengths=None) -> np.ndarray:
        """New tokens per sequence ``(B,)`` (checked as :meth:`qkv.nn.Cache.counts` does), and
        a ShapeError when they would pass ``max_len``."""
        counts = Cache.counts(self, t, q_lengths)
        ends = self.lengths + counts
        if ends.max(initial=0) > self.max_len:
            b = int(np.argmax(ends))
            raise ShapeError(f"the cache is full: sequence {b} holds {int(self.lengths[b])} of max_len = "
                             f"{self.max_len} tokens and cannot take {int(counts[b])} more; make it with "
                             f"new_cache(batch, max_len >= {int(ends.max())})")
        return counts

    def advance(self, counts) -> None:
        self.lengths = self.lengths + np.asarray(counts, dtype=np.int64)

    def row(self, b: int) -> GPTCache:
        """Sequence ``b`` alone: a batch-1 cache whose entries are views of row b of these."""
        out = GPTCache([_row(entry, b, int(self.lengths[b])) for entry in self], 1, self.max_len)
        out.lengths = self.lengths[b:b + 1].copy()
        return out

    def take_row(self, view: GPTCache, b: int) -> None:
        """Record what ``view = row(b)`` holds now (its arrays are already ours)."""
        for entry, part in zip(self, view):
            if isinstance(entry, Cache):
                entry.lengths = entry.lengths.copy()
                entry.lengths[b] = part.lengths[0]
            else:
                entry.length = max(entry.length, part.length)  # the longest sequence's, as Cache.length
        self.lengths = self.lengths.copy()
        self.lengths[b] = view.lengths[0]

    def reset(self) -> None:
        """Forget every token (the memory is reused)."""
        for entry in self:
            entry.reset()
        self.lengths = np.zeros(self.batch, dtype=np.int64)

    def __repr__(self) -> str:
        filled = self.lengths.tolist() if np.ptp(self.lengths) else self.length
        kinds = ", ".join(type(e).__name__ for e in self)
        return f"GPTCache({filled}/{self.max_len} tokens, batch {self.batch}: {kinds})"


def _row(entry, b: int, length: int):
    """Row ``b`` of one block's cache or state, as a batch-1 one over the same memory."""
    view = copy.copy(entry)
    if isinstance(entry, Cache):
        view.arrays = {name: a[b:b + 1] for name, a in entry.arrays.items()}
        view.batch = 1
        view.lengths = entry.lengths[b:b + 1].copy()
        if isinstance(entry, ConvKVCache):
            view.conv = entry.conv[b:b + 1]
    elif isinstance(entry, RecurrentState):
        view.conv, view.recurrent, view.length = entry.conv[b:b + 1], entry.recurrent[b:b + 1], length
    elif isinstance(entry, LinearState):
        view.s, view.comp, view.length = entry.s[b:b + 1], entry.comp[b:b + 1], length
    else:
        raise ShapeError(f"cache entries must be qkv.nn caches or states; got {type(entry).__name__} "
                         f"{fmt_shape(getattr(entry, 'shape', ()))}")
    return view
