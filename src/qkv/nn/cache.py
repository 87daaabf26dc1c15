"""KV caches for decoding: preallocated per-token arrays a causal layer appends to.

Generating text one token at a time, a causal layer would recompute every earlier key and
value at each step. A cache keeps them: a prefill of the prompt writes its T keys, then
each new token appends one and attends to everything stored, with the newest query
aligned to the newest key (``causal=True, align="bottom_right"``). Each sequence of a batch
has its own length, so prompts of different lengths are prefilled together (right-padded,
with ``q_lengths``) and then decoded one token per sequence per step. :class:`KVCache` stores k and v
(MHA, GQA, MQA); :class:`LatentCache` stores MLA's latent and RoPE key. What each costs per
token is :mod:`qkv.nn.footprint` (``qkv cache-table``).
"""
from __future__ import annotations

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

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        first = next(iter(arrays.values()))
        self.batch, self.max_len = first.shape[0], first.shape[-2]
        self.lengths = np.zeros(self.batch, dtype=np.int64)

    @property
    def length(self) -> int:
        """Tokens filled in the longest sequence (every sequence's, when they are equal)."""
        return int(self.lengths.max(initial=0))

    @property
    def ragged(self) -> bool:
        """True when the sequences hold different numbers of tokens."""
        return bool(self.lengths.size) and int(self.lengths.min()) != self.length

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (allocated for all ``max_len`` tokens)."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence costs: ``nbytes / (B * max_len)``."""
        return self.nbytes // (self.batch * self.max_len)

    def __getitem__(self, name: str) -> np.ndarray:
        """Array ``name`` over positions ``0 .. length-1`` ``(B, ..., length, F)``; a shorter
        sequence's positions past its own length hold nothing of meaning."""
        return self.arrays[name][..., : self.length, :]

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
        """
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
        counts = self.counts(t) if counts is None else counts
        ends = self.lengths + counts
        end = int(ends.max(initial=0))
        if end > self.max_len:
            b = int(np.argmax(ends))
            who = f"sequence {b} holds" if self.ragged or np.ptp(counts) else "it holds"
            raise ShapeError(f"the KV cache is full: {who} {int(self.lengths[b])} of max_len = "
                             f"{self.max_len} tokens and cannot take {int(counts[b])} more; make it with "
                             f"new_cache(batch, max_len >= {end})")
        for name, x in new.items():
            store = self.arrays[name]
            if not self.ragged and (counts == t).all():  # every sequence alike: one slice
                store[..., self.length:end, :] = x
                continue
            for b in range(self.batch):
                store[b, ..., self.lengths[b]:ends[b], :] = x[b, ..., :counts[b], :]
        return {name: a[..., :end, :] for name, a in self.arrays.items()}

    def advance(self, counts) -> None:
        """Mark ``counts`` more tokens as filled (an int for every sequence, or ``(B,)``),
        after a successful :meth:`write`."""
        self.lengths = self.lengths + np.asarray(counts, dtype=np.int64)

    def reset(self) -> None:
        """Forget every stored token (the memory is reused)."""
        self.lengths = np.zeros(self.batch, dtype=np.int64)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n} {fmt_shape(a.shape)}" for n, a in self.arrays.items())
        filled = self.lengths.tolist() if self.ragged else self.length
        return f"{type(self).__name__}({filled}/{self.max_len} tokens, {shapes}, {self.nbytes} bytes)"


class KVCache(Cache):
    """Keys ``k (B, Hkv, max_len, D)`` and values ``v (B, Hkv, max_len, Dv)`` of one layer.

    Keys are stored after RoPE (each rotated by its own position), as in Llama.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, dtype=np.float32,
                 d_value: int | None = None):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        d_value = d_head if d_value is None else d_value
        super().__init__({"k": np.zeros((batch, n_kv_heads, max_len, d_head), dtype=dtype),
                          "v": np.zeros((batch, n_kv_heads, max_len, d_value), dtype=dtype)})


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
