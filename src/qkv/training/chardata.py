"""Character-level language-model data, as nanoGPT's ``shakespeare_char``: a tokenizer whose
vocabulary is the corpus's characters, a 90/10 train/val split, and random batches.

A token is a character's index in the sorted set of the corpus's characters (65 for Tiny
Shakespeare). The split is the first 90 % of the encoded text for training and the last
10 % for validation, as nanoGPT's ``prepare.py``. A batch is ``B`` windows of ``T + 1``
tokens starting at random offsets: ``x`` is each window's first ``T`` tokens and ``y`` the
same shifted by one, so ``y[b, t]`` is the token that follows ``x[b, :t + 1]``::

    data    ... 17 42  5 33  8 ...
    x[b]        17 42  5 33          (T = 4)
    y[b]           42  5 33  8

NumPy only. Every random draw takes a :class:`numpy.random.Generator`; saving its
``bit_generator.state`` is enough to continue the same stream of batches later.

>>> tok = CharTokenizer.from_text("hello world")
>>> tok.vocab_size, tok.decode(tok.encode("low hello"))
(8, 'low hello')
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError

VAL_FRACTION = 0.1  # nanoGPT's split: the last 10 % of the text is validation


class CharTokenizer:
    """Characters to token ids and back; the vocabulary is a sorted string of distinct characters."""

    def __init__(self, chars: str):
        if not isinstance(chars, str) or not chars:
            raise ShapeError(f"chars must be a non-empty string of distinct characters; got {chars!r}")
        if len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise ShapeError("chars must be distinct characters in sorted order; "
                             f"got {len(chars)} characters, {len(set(chars))} distinct")
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self._table = np.array(list(chars))  # id -> character, for decode

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The vocabulary of ``text``: its distinct characters, sorted (nanoGPT's ``stoi``)."""
        if not text:
            raise ShapeError("text must contain at least one character to make a vocabulary; got ''")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, dtype=np.int64) -> np.ndarray:
        """``text`` as token ids, ``(len(text),)`` of ``dtype`` (int64 unless told). A character
        outside the vocabulary raises ShapeError naming it."""
        try:
            return np.fromiter((self.index[c] for c in text), dtype=dtype, count=len(text))
        except KeyError:
            unknown = sorted(set(text) - set(self.chars))
            raise ShapeError(f"text has {len(unknown)} characters outside the vocabulary of "
                             f"{self.vocab_size}: {''.join(unknown)[:40]!r}") from None

    def decode(self, ids) -> str:
        """Token ids (any shape; flattened) back to text."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ShapeError(f"ids must be ints in [0, vocab_size) = [0, {self.vocab_size}); "
                             f"got {ids.dtype} from {ids.min()} to {ids.max()}")
        return "".join(self._table[ids].tolist())

    def to_dict(self) -> dict:
        """What a checkpoint's config stores (JSON): ``{"kind": "char", "chars": ...}``."""
        return {"kind": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        if not isinstance(d, dict) or d.get("kind") != "char" or not isinstance(d.get("chars"), str):
            raise ShapeError(f"a character tokenizer is stored as {{'kind': 'char', 'chars': str}}; got {d!r}"[:200])
        return cls(d["chars"])


def split(ids: np.ndarray, val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the first ``1 - val_fraction`` of ``ids`` and the rest (views, in order).

    >>> train, val = split(np.arange(10))
    >>> train.tolist(), val.tolist()
    ([0, 1, 2, 3, 4, 5, 6, 7, 8], [9])
    """
    if not 0.0 < val_fraction < 1.0:
        raise ShapeError(f"val_fraction must lie in (0, 1); got {val_fraction}")
    n = int(len(ids) * (1.0 - val_fraction))
    return ids[:n], ids[n:]


def ids_dtype(vocab_size: int):
    """The smallest unsigned dtype that holds every id of a vocabulary: uint16 up to 65,536
    tokens (nanoGPT's ``.bin`` files), else uint32. Ids are kept in it; batches are int64."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def get_batch(data: np.ndarray, batch_size: int, block_size: int, rng: np.random.Generator):
    """``(x, y)``, each ``(B, T)`` int64: ``B = batch_size`` windows of ``T = block_size``
    tokens at offsets drawn uniformly from ``[0, len(data) - T)`` (nanoGPT's ``get_batch``),
    ``y`` shifted one token right of ``x``. Draws exactly one ``rng.integers`` call. ``data``
    may be any 1-D int array, a memory map included: only the windows are read."""
    if len(data) <= block_size:
        raise ShapeError(f"data must be longer than block_size = {block_size} tokens to cut a window "
                         f"and its next token; got {len(data)} tokens")
    ix = rng.integers(0, len(data) - block_size, size=batch_size)  # (B,)
    offsets = ix[:, None] + np.arange(block_size)  # (B, T)
    return data[offsets].astype(np.int64), data[offsets + 1].astype(np.int64)


class TokenDataset:
    """Token ids to train on: ``tokenizer``, ``train`` and ``val`` 1-D id arrays (in memory or
    memory-mapped), and :meth:`batch`."""

    def __init__(self, train: np.ndarray, val: np.ndarray, tokenizer):
        self.train, self.val, self.tokenizer = train, val, tokenizer

    def batch(self, split_name: str, batch_size: int, block_size: int, rng: np.random.Generator):
        """``get_batch`` from the ``"train"`` or ``"val"`` part."""
        if split_name not in ("train", "val"):
            raise ShapeError(f"split must be 'train' or 'val'; got {split_name!r}")
        return get_batch(getattr(self, split_name), batch_size, block_size, rng)


class CharDataset(TokenDataset):
    """A text made into tokens: ``tokenizer``, ``train`` and ``val`` id arrays.

    ``tokenizer`` defaults to the text's own vocabulary; pass a saved one (resuming a run)
    and every character of the text must be in it. The ids are held in the smallest dtype
    that fits (:func:`ids_dtype`: 2 bytes a character, not 8)."""

    def __init__(self, text: str, tokenizer: CharTokenizer | None = None, val_fraction: float = VAL_FRACTION):
        tokenizer = tokenizer or CharTokenizer.from_text(text)
        self.ids = tokenizer.encode(text, ids_dtype(tokenizer.vocab_size))
        super().__init__(*split(self.ids, val_fraction), tokenizer)
