"""KV caches for decoding: preallocated per-token arrays a causal layer appends to.

Generating text one token at a time, a causal layer would recompute every earlier key and
value at each step. A cache keeps them: a prefill of the prompt writes its T keys, then
each new token appends one and attends to everything stored, with the newest query
aligned to the newest key (``causal=True, align="bottom_right"``). Each sequence of a batch
has its own length, so prompts of different lengths are prefilled together (right-padded,
with ``q_lengths``) and then decoded one token per sequence per step. :class:`KVCache` stores k and v
(MHA, GQA, MQA); :class:`LatentCache` stores MLA's latent and RoPE key. What each costs per
token is :mod:`qkv.nn.footprint` (``qkv cache-table``).

**A window's cache rolls.** A causal layer with ``window=W`` (``(W, right)``; no chunk) lets the
query at position p see keys ``p-W .. p`` only (:func:`qkv.attention`'s ``window``), so a key
W or more positions behind the newest token is never read again. Its cache
(``KVCache(..., window=W)``) keeps the last W keys of each sequence and no more: a ring of
``slots = min(W, max_len)`` rows, the key of position p in row ``p mod slots``. A call gathers
each sequence's kept keys in order and puts its new ones after them (W + 1 keys for a decoding
step: the window and the step's own), so the masks see the same relative positions as over the
whole sequence; the keys keep the RoPE rotation of the position they were written at. The new
keys go into the ring only at :meth:`Cache.advance`, once the step succeeded. The bytes are
flat in the context length; ``max_len`` still bounds each sequence's tokens.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError, fmt_shape, positive_int


class Cache:
    """Preallocated per-token arrays, each ``(B, ..., max_len, F)`` (time on axis -2).

    The arrays are NumPy arrays here; :class:`qkv.torch.KVCache` keeps torch tensors under
    the same bookkeeping (``lengths`` is a NumPy ``(B,)`` in both), which only slices them.

    Sequence b has ``lengths[b]`` tokens filled. A layer calls :meth:`write` to put new
    tokens after them (the returned views cover every position up to the longest sequence)
    and :meth:`advance` once the step succeeded, so a failed call leaves the cache as it
    was. Writing past ``max_len`` raises :class:`~qkv.ShapeError`: a full cache is never
    silently overwritten.
    """

    def __init__(self, arrays: dict[str, np.ndarray], *, max_len: int | None = None, window: int | None = None):
        self.arrays = arrays
        first = next(iter(arrays.values()))
        self.batch, self.slots = first.shape[0], first.shape[-2]
        self.max_len = self.slots if max_len is None else max_len
        self.window = window  # None: every token kept; W: the last min(W, max_len) (see the module docstring)
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self._pending = None  # a rolling cache's last write, put into the ring by advance

    @property
    def length(self) -> int:
        """Tokens filled in the longest sequence (every sequence's, when they are equal)."""
        return int(self.lengths.max(initial=0))

    @property
    def ragged(self) -> bool:
        """True when the sequences hold different numbers of tokens."""
        return bool(self.lengths.size) and int(self.lengths.min()) != self.length

    @property
    def held(self) -> np.ndarray:
        """Tokens each sequence has in the arrays ``(B,)``: ``lengths``, or at most ``slots``
        for a rolling cache (``window``)."""
        return self.lengths if self.window is None else np.minimum(self.lengths, self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (allocated for all ``max_len`` tokens, or a window's ``slots``)."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence costs (``nbytes / (B * max_len)`` without a window)."""
        return int(sum(a.itemsize * math.prod(a.shape[1:-2]) * a.shape[-1] for a in self.arrays.values()))

    def __getitem__(self, name: str) -> np.ndarray:
        """Array ``name`` over positions ``0 .. length-1`` ``(B, ..., length, F)``; a shorter
        sequence's positions past its own length hold nothing of meaning. A rolling cache gives
        (a copy of) each sequence's kept tokens in order, ``(B, ..., max_b held[b], F)``."""
        if self.window is None:
            return self.arrays[name][..., : self.length, :]
        store, held = self.arrays[name], self.held
        out = np.zeros(store.shape[:-2] + (int(held.max(initial=0)),) + store.shape[-1:], store.dtype)
        for b in range(self.batch):
            for rows, at in self._ring(int(self.lengths[b]), int(held[b])):
                out[b, ..., at, :] = store[b, ..., rows, :]
        return out

    def _ring(self, end: int, n: int) -> list[tuple[slice, slice]]:
        """Where positions ``end-n .. end-1`` are in a rolling cache's ring: ``(ring rows, i)``
        pairs (at most two, the ring wrapping once), ``i`` counting the n positions from 0."""
        first = (end - n) % self.slots if n else 0
        head = min(n, self.slots - first)                   # up to the ring's last row, then from row 0
        return [(slice(first, first + head), slice(0, head)), (slice(0, n - head), slice(head, n))][:1 + (n > head)]

    def counts(self, t: int, q_lengths=None) -> np.ndarray:
        """New tokens per sequence ``(B,)``: ``q_lengths`` (right-padded input) or ``t`` each."""
        if q_lengths is None:
            return np.full(self.batch, t, dtype=np.int64)
        n = np.asarray(q_lengths)
        if n.dtype.kind not in "iu" or n.shape != (self.batch,) or (n < 0).any() or (n > t).any():
            raise ShapeError(f"q_lengths must be ints in [0, T] = [0, {t}] of shape (B,) = ({self.batch},); "
                             f"got {fmt_shape(n.shape)} {n.dtype} {n.tolist() if n.size <= 8 else ''}")
        return n.astype(np.int64)

    def write(self, counts: np.ndarray | None = None, **new: np.ndarray) -> dict[str, np.ndarray]:
        """Store ``new[name] (B, ..., T, F)``: for sequence b its first ``counts[b]`` tokens
        (default all T) at positions ``lengths[b] ..``.

        Returns views of every array over positions ``0 .. max_b(lengths[b] + counts[b]) - 1``.
        Does not move ``lengths``; call :meth:`advance` (counts) when the step is done.
        A rolling cache (``window``) returns new arrays instead: sequence b's ``held[b]`` kept
        tokens in order, then its new ones (``max_b(held[b] + counts[b])`` positions), and
        stores the new tokens at :meth:`advance`.
        """
        t = self._check_new(new)
        counts = self.counts(t) if counts is None else counts
        self._check_room(counts)
        if self.window is not None:
            return self._gather(counts, new, t)
        ends = self.lengths + counts
        end = int(ends.max(initial=0))
        for name, x in new.items():
            store = self.arrays[name]
            if not self.ragged and (counts == t).all():  # every sequence alike: one slice
                store[..., self.length:end, :] = x
                continue
            for b in range(self.batch):
                store[b, ..., self.lengths[b]:ends[b], :] = x[b, ..., :counts[b], :]
        return {name: a[..., :end, :] for name, a in self.arrays.items()}

    def _check_new(self, new: dict) -> int:
        """The new tokens' T, once every array of ``new`` is ``(B, ..., T, F)`` as stored."""
        if set(new) != set(self.arrays):
            raise ShapeError(f"cache.write needs arrays {sorted(self.arrays)}; got {sorted(new)}")
        t = None
        for name, x in new.items():
            store = self.arrays[name]
            want = store.shape[:-2] + (x.shape[-2],) + store.shape[-1:]
            if x.shape != want or (t is not None and x.shape[-2] != t):
                lead = ", ".join(str(n) for n in store.shape[:-2])
                raise ShapeError(f"the new {name} for the cache must have shape (B, ..., T, F) = "
                                 f"({lead}, T, {store.shape[-1]}); got {fmt_shape(x.shape)}"
                                 " (was the cache made for another batch size or layer?)")
            t = x.shape[-2]
        return t

    def _check_room(self, counts: np.ndarray) -> None:
        """A ShapeError, naming the sequence, when ``counts`` more tokens pass ``max_len``."""
        ends = self.lengths + counts
        end = int(ends.max(initial=0))
        if end > self.max_len:
            b = int(np.argmax(ends))
            who = f"sequence {b} holds" if self.ragged or np.ptp(counts) else "it holds"
            raise ShapeError(f"the KV cache is full: {who} {int(self.lengths[b])} of max_len = "
                             f"{self.max_len} tokens and cannot take {int(counts[b])} more; make it with "
                             f"new_cache(batch, max_len >= {end})")

    def _gather(self, counts: np.ndarray, new: dict, t: int) -> dict[str, np.ndarray]:
        """A rolling cache's :meth:`write`: for sequence b its ``held[b]`` kept tokens in order,
        then its ``counts[b]`` new ones, ``(B, ..., max_b(held[b] + counts[b]), F)`` (new arrays;
        the ring is untouched until :meth:`advance`)."""
        held = self.held
        end = int((held + counts).max(initial=0))
        alike = self.lengths.min() == self.lengths.max() and (counts == t).all()
        rows = range(1) if alike else range(self.batch)     # alike: every sequence at once, in one order
        out = {}
        for name, x in new.items():
            store = self.arrays[name]
            a = (np.empty if alike else np.zeros)(store.shape[:-2] + (end,) + store.shape[-1:], store.dtype)
            for b in rows:
                at = slice(None) if alike else b
                h, n = int(held[b]), int(counts[b])
                for ring, i in self._ring(int(self.lengths[b]), h):
                    a[at, ..., i, :] = store[at, ..., ring, :]
                a[at, ..., h:h + n, :] = x[at, ..., :n, :]
            out[name] = a
        self._pending = (out, held, counts, alike)
        return out

    def advance(self, counts) -> None:
        """Mark ``counts`` more tokens as filled (an int for every sequence, or ``(B,)``),
        after a successful :meth:`write` (a rolling cache stores that write's tokens now)."""
        counts = np.broadcast_to(np.asarray(counts, dtype=np.int64), self.lengths.shape)
        if self._pending is not None:
            self._commit(counts)
        self.lengths = self.lengths + counts

    def _commit(self, counts: np.ndarray) -> None:
        """Put the last ``min(counts[b], slots)`` new tokens of the pending write into the ring."""
        out, held, written, alike = self._pending
        self._pending = None
        if not np.array_equal(counts, written):
            raise ShapeError(f"advance(counts) must take the counts of the write before it, "
                             f"{written.tolist()}; got {counts.tolist()}")
        for name, a in out.items():
            store = self.arrays[name]
            for b in (range(1) if alike else range(self.batch)):
                at = slice(None) if alike else b
                n = min(int(counts[b]), self.slots)
                top, end = int(held[b] + counts[b]), int(self.lengths[b] + counts[b])
                for ring, i in self._ring(end, n):
                    store[at, ..., ring, :] = a[at, ..., top - n:top, :][..., i, :]

    def reset(self) -> None:
        """Forget every stored token (the memory is reused)."""
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self._pending = None

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n} {fmt_shape(a.shape)}" for n, a in self.arrays.items())
        filled = self.lengths.tolist() if self.ragged else self.length
        kept = "" if self.window is None else f", the last {self.slots} kept"
        return f"{type(self).__name__}({filled}/{self.max_len} tokens{kept}, {shapes}, {self.nbytes} bytes)"


class KVCache(Cache):
    """Keys ``k (B, Hkv, max_len, D)`` and values ``v (B, Hkv, max_len, Dv)`` of one layer.

    Keys are stored after RoPE (each rotated by its own position), as in Llama. With
    ``window=W`` (a causal windowed layer's, see the module docstring) only the last W tokens
    are kept: ``k (B, Hkv, min(W, max_len), D)``, a ring.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, dtype=np.float32,
                 d_value: int | None = None, *, window: int | None = None):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        if window is not None:
            window = positive_int("window", window, 0)
        d_value = d_head if d_value is None else d_value
        slots = max_len if window is None else min(window, max_len)
        super().__init__({"k": np.zeros((batch, n_kv_heads, slots, d_head), dtype=dtype),
                          "v": np.zeros((batch, n_kv_heads, slots, d_value), dtype=dtype)},
                         max_len=max_len, window=window)


class LatentCache(Cache):
    """MLA's cache: one array ``latent (B, 1, max_len, d_latent + d_rope)`` per layer.

    Columns ``[:d_latent]`` hold the compressed ``c_KV`` of each token (keys and values
    of every head come up from it), columns ``[d_latent:]`` the decoupled RoPE key
    ``k_R`` shared by all heads. Kept as one array so that decoding attends to it in
    place: the keys are whole rows, the values a view of the first ``d_latent`` columns.
    """

    def __init__(self, batch: int, max_len: int, d_latent: int, d_rope: int = 0, dtype=np.float32):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        self.d_latent, self.d_rope = d_latent, d_rope
        super().__init__({"latent": np.zeros((batch, 1, max_len, d_latent + d_rope), dtype=dtype)})
