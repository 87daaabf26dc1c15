"""Sampling from a :class:`~qkv.models.GPT`: prefill the prompt into the KV cache, then one token a step.

Without a cache, each new token costs a forward over the whole sequence (nanoGPT's
``generate``). With one (:meth:`GPT.new_cache`, a :class:`qkv.nn.KVCache` per block), the
prompt's keys and values are computed once (the prefill) and each step feeds only the
newest token, whose query attends to everything stored (bottom-right aligned). Both give
the same logits up to rounding, so greedy decoding picks the same tokens; the tests hold
them to 1e-12 in float64.

Prompts of different lengths go in one batch: they are right-padded and prefilled with
``q_lengths``, each sequence's cache holds its own length, and every step appends one token
to each (the ragged cache of :mod:`qkv.nn.cache`). As nanoGPT does, a model never sees more
than ``block_size`` tokens: once a sequence would pass that, each step runs uncached on its
last ``block_size`` tokens (a cache cannot slide under learned positions), which is what
generation without a cache computes too.

A hybrid model (:mod:`qkv.models.hybrid`) caches keys and values for its attention blocks and
a fixed-size state for the others (:class:`~qkv.models.gpt_cache.GPTCache`). A state holds
no length per sequence, so a ragged batch of prompts is prefilled one prompt at a time into
its rows (:meth:`GPT.forward` does this given ``q_lengths``); then the batch decodes together.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int


def _prompts(idx) -> tuple[list[np.ndarray], str]:
    """The prompts as a list of 1-D int arrays, and the form they came in ("2d", "1d", "list")."""
    if isinstance(idx, (list, tuple)) and idx and not np.isscalar(idx[0]):
        form, rows = "list", [np.asarray(p) for p in idx]
    else:
        a = np.asarray(idx)
        form = {1: "1d", 2: "2d"}.get(a.ndim)
        if form is None:
            raise ShapeError(f"idx must be token ids (B, T), (T,) or a list of 1-D prompts; got shape {a.shape}")
        rows = [a] if a.ndim == 1 else list(a)
    for n, p in enumerate(rows):
        if p.ndim != 1 or p.size == 0 or p.dtype.kind not in "iu":
            raise ShapeError(f"prompt {n} must be a non-empty 1-D int array of token ids; got {p.dtype} {p.shape}")
    return [p.astype(np.int64) for p in rows], form


def sample(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
    """One token per row of ``logits (B, V)``: the argmax for ``temperature == 0``, else a draw
    from ``softmax(logits / temperature)`` over the ``top_k`` largest (all when None).

    The scores are shifted by their maximum before the division, ``z = (logits - max) / temperature``
    (the softmax is the same), so a tiny temperature drives every score but the largest to
    ``-inf`` and the draw to the argmax, as the limit says, instead of overflowing to
    ``inf - inf = NaN``."""
    if temperature == 0 or top_k == 1:
        return np.argmax(logits, axis=-1)
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)                              # <= 0, the largest 0
    with np.errstate(over="ignore"):
        z /= temperature                                            # -inf where it overflows: weight 0
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]  # (B, 1): the k-th largest
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    cdf = np.cumsum(p, axis=-1)                                     # (B, V), unnormalised
    u = rng.random(len(z))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), z.shape[-1] - 1)     # inverse CDF


def _window_logits(model, seqs: list[np.ndarray]) -> np.ndarray:
    """Last-position logits ``(B, V)`` of each sequence, uncached, on its last block_size tokens
    (sequences of one length in one batch)."""
    bs = model.config.block_size
    crops = [s[-bs:] for s in seqs]
    out = np.empty((len(seqs), model.config.vocab_size), dtype=model.dtype)
    for n in sorted({len(c) for c in crops}):
        rows = [i for i, c in enumerate(crops) if len(c) == n]
        out[rows] = model.forward(np.stack([crops[i] for i in rows]))[:, -1]
    return out


def _prefill(model, seqs: list[np.ndarray], max_len: int):
    """A cache holding every prompt, and the prompts' last-position logits ``(B, V)``."""
    lengths = np.array([len(s) for s in seqs])
    padded = np.zeros((len(seqs), int(lengths.max())), dtype=np.int64)
    for b, s in enumerate(seqs):
        padded[b, :len(s)] = s
    cache = model.new_cache(len(seqs), max_len)
    ragged = bool(np.ptp(lengths))
    logits = model.forward(padded, cache=cache, q_lengths=lengths if ragged else None)  # (B, T, V)
    return cache, logits[np.arange(len(seqs)), lengths - 1]


def generate(model, idx, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             rng: np.random.Generator | None = None, use_cache: bool = True, return_logits: bool = False):
    """Continue each prompt of ``idx`` by ``max_new_tokens`` tokens.

    ``idx``: ``(B, T)`` ids (returns ``(B, T + max_new_tokens)``), ``(T,)`` (returns 1-D), or a
    list of 1-D prompts of any lengths (returns a list). ``temperature = 0`` (or ``top_k = 1``)
    is greedy; otherwise tokens are drawn from ``rng`` (a Generator; a fresh one if None).
    ``use_cache=False`` recomputes the whole window each step (the reference the cached
    path is tested against). ``return_logits`` also returns the logits each new token was
    chosen from, ``(B, max_new_tokens, V)``. The model runs in eval mode meanwhile.
    """
    seqs, form = _prompts(idx)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens, 0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < np.inf:
        raise ShapeError(f"temperature must be a finite number >= 0; got {temperature!r}")
    if top_k is not None:
        top_k = positive_int("top_k", top_k)
    for n, s in enumerate(seqs):
        if s.max() >= model.config.vocab_size:
            raise ShapeError(f"prompt {n} has token id {int(s.max())}, past vocab_size = {model.config.vocab_size}")
    rng = np.random.default_rng() if rng is None else rng
    bs, was_training = model.config.block_size, model.training
    model.eval()
    try:
        cache = None
        longest = max(len(s) for s in seqs)
        if use_cache and longest <= bs and max_new_tokens:
            cache, last = _prefill(model, seqs, min(bs, longest + max_new_tokens))
        elif max_new_tokens:
            last = _window_logits(model, seqs)
        kept = []
        for step in range(max_new_tokens):
            kept.append(last)
            tok = sample(last, temperature, top_k, rng)             # (B,)
            seqs = [np.append(s, t) for s, t in zip(seqs, tok)]
            if step == max_new_tokens - 1:
                break
            if cache is not None and cache.length < cache.max_len:
                last = model.forward(tok[:, None], cache=cache)[:, 0]  # (B, 1) -> (B, V)
            else:
                cache, last = None, _window_logits(model, seqs)
    finally:
        model.train(was_training)
    out = seqs if form == "list" else (seqs[0] if form == "1d" else np.stack(seqs))
    if not return_logits:
        return out
    logits = np.stack(kept, axis=1) if kept else np.zeros((len(seqs), 0, model.config.vocab_size), model.dtype)
    return out, logits
