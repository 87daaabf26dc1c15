"""The multi-query associative recall (MQAR) task of Zoology (Arora et al., 2023, arXiv:2312.04927).

One sequence of ``T`` token ids (vocabulary ``V``; keys from ``[1, V/2)``, values from
``[V/2, V)``, disjoint halves)::

    k1 v1 k2 v2 ... kP vP | n n k3 n n n k1 n ... k5 n n n
    <---- 2P: the pairs --> <------- T - 2P: queries and noise ------>

The first ``2P`` tokens are the ``P`` (key, value) pairs, keys distinct and values distinct
within a sequence. After them come ``Q`` queries (``Q <= P``; Zoology queries every key,
``Q = P``): keys of the pairs, each at an even offset ``2 g`` into the rest of the sequence,
the slots ``g`` drawn one after another without replacement from ``0 .. (T - 2P)/2 - 1`` with
probability ``∝ (g + 1)^(a - 1)`` (Zoology's power law, ``a = 0.01``: most queries come soon
after the pairs, a few far), and, as Zoology's ``multiquery_ar`` does, the i-th slot drawn
asks pair i: earlier pairs tend to be asked sooner. The draws are Gumbel-top-k (the slots
sorted by ``log p + Gumbel noise``), whose order is that of drawing one by one. Every other
position holds the filler: a uniformly random token of the whole vocabulary (``filler =
"random"``, Zoology's ``random_non_queries``, its default), or 0 (``"zero"``). With random
filler a query's key can also turn up as noise before it; at Zoology's vocabulary of 8192
that is rare (about 0.4 % of queries at 64 pairs and T = 256), at a few hundred it is not. The target at a query's position is its key's value (next-token
prediction: having read the key, emit the value); every other target is ``-1``, no target,
which :meth:`qkv.models.GPT.loss` leaves out of the loss, and :func:`query_accuracy` out of
the accuracy.

``2P + 2Q <= T`` is what fits (Zoology asks ``4P <= T`` for ``Q = P``).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int

POWER_A = 0.01   # Zoology's power_a: the query slots' power-law exponent
VOCAB = 8192     # Zoology's vocab_size for MQAR
FILLERS = ("random", "zero")


def check_task(pairs: int, seq_len: int, vocab_size: int, queries: int | None = None) -> int:
    """A ShapeError naming the argument for a task no sequence can hold; returns ``Q``."""
    positive_int("pairs", pairs)
    positive_int("seq_len", seq_len)
    positive_int("vocab_size", vocab_size)
    q = pairs if queries is None else positive_int("queries", queries)
    if q > pairs:
        raise ShapeError(f"queries must be <= pairs (each query asks a different key); got queries = {q}, "
                         f"pairs = {pairs}")
    if 2 * pairs + 2 * q > seq_len:
        raise ShapeError(f"seq_len must hold the pairs and the queries, 2·pairs + 2·queries = {2 * pairs + 2 * q} "
                         f"tokens; got seq_len = {seq_len}")
    if pairs > vocab_size // 2 - 1:
        raise ShapeError(f"vocab_size must leave distinct keys for every pair: keys are [1, vocab_size/2), "
                         f"{vocab_size // 2 - 1} of them, for pairs = {pairs}; got vocab_size = {vocab_size}")
    return q


def _distinct(rng: np.random.Generator, batch: int, low: int, high: int, n: int) -> np.ndarray:
    """``(batch, n)`` ints from ``[low, high)``, distinct within each row."""
    return np.argsort(rng.random((batch, high - low)), axis=1)[:, :n] + low


def mqar_batch(rng: np.random.Generator, batch: int, pairs: int, seq_len: int, vocab_size: int,
               queries: int | None = None, power_a: float = POWER_A, filler: str = "random") -> dict:
    """One batch of MQAR: ``inputs (B, T)`` and ``targets (B, T)`` int64 (``-1`` but at the queries).

    Also ``keys``, ``values`` ``(B, P)`` and ``query_pos`` ``(B, Q)`` (where each query sits:
    ``query_pos[:, i]`` asks pair i). Drawn from ``rng`` only: the same Generator state gives
    the same batch.
    """
    positive_int("batch", batch)
    q = check_task(pairs, seq_len, vocab_size, queries)
    if filler not in FILLERS:
        raise ShapeError(f"filler must be one of {list(FILLERS)}; got {filler!r}")
    half = vocab_size // 2
    keys = _distinct(rng, batch, 1, half, pairs)                     # (B, P) in [1, V/2)
    values = _distinct(rng, batch, half, vocab_size, pairs)           # (B, P) in [V/2, V)
    space = (seq_len - 2 * pairs) // 2                                 # query slots after the pairs
    logp = (power_a - 1) * np.log(np.arange(1, space + 1))            # log p(g) up to a constant
    gumbel = -np.log(-np.log(rng.random((batch, space))))
    slots = np.argsort(-(logp + gumbel), axis=1)[:, :q]                # (B, Q): in the order drawn, ∝ p
    asked = np.broadcast_to(np.arange(q), (batch, q))                  # the i-th slot drawn asks pair i
    if filler == "random":
        inputs = rng.integers(0, vocab_size, size=(batch, seq_len))    # noise everywhere first
    else:
        inputs = np.zeros((batch, seq_len), dtype=np.int64)
    inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values
    rows = np.arange(batch)[:, None]
    query_pos = 2 * pairs + 2 * slots                                  # (B, Q)
    inputs[rows, query_pos] = keys[rows, asked]
    targets = np.full((batch, seq_len), -1, dtype=np.int64)
    targets[rows, query_pos] = values[rows, asked]
    return {"inputs": inputs.astype(np.int64), "targets": targets, "keys": keys, "values": values,
            "query_pos": query_pos}


def query_accuracy(logits: np.ndarray, targets: np.ndarray) -> float:
    """The fraction of query positions (``targets != -1``) where ``argmax(logits)`` is the target.

    ``logits (B, T, V)``, ``targets (B, T)``; positions with target ``-1`` do not count.

    >>> t = np.array([[-1, 3, -1, 2]])
    >>> query_accuracy(np.eye(4)[[[0, 3, 1, 1]]], t)
    0.5
    """
    logits, targets = np.asarray(logits), np.asarray(targets)
    if logits.shape[:-1] != targets.shape:
        raise ShapeError(f"targets must have logits' shape without its last axis, {logits.shape[:-1]}; "
                         f"got {targets.shape}")
    asked = targets != -1
    if not asked.any():
        raise ShapeError("targets has no query position (every target is -1)")
    return float(np.mean(np.argmax(logits[asked], axis=-1) == targets[asked]))
