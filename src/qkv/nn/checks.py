"""What an attention layer's arguments must be, said once for the NumPy layers and their
PyTorch twins (:mod:`qkv.torch`), so that both refuse the same things with the same words.

- construction: the mask options (``causal``, ``align``, ``window``, ``chunk``, parsed so
  that a bad value fails in the constructor, not at the first forward), the head layout
  (``n_heads``, ``n_kv_heads``, ``d_head``) and RoPE (an even ``d_head``, ``rope_base > 1``);
- each call: the shapes of ``x`` and ``context`` (checked on ``.shape``, so an array and a
  tensor are held to one rule), ``cache=`` (the layer's own kind, on causal self-attention),
  one step on a ragged cache (:func:`cache_step`) and the keyword arguments of
  :func:`qkv.attention` that a layer's options and the call make (:func:`attention_options`).

Everything here reads shapes and plain values only; nothing computes.
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import ShapeError, fmt_shape, positive_int
from ..options import parse_alignment, parse_chunk, parse_window
from ..positional import check_base


# --- construction ----------------------------------------------------------------------------
def mask_options(causal=False, align=None, window=None, chunk=None) -> None:
    """Raise now if ``causal``, ``align``, ``window`` or ``chunk`` would be refused by
    :func:`qkv.attention` (a layer keeps them as given and passes them on each call)."""
    parse_alignment(causal, align)
    parse_window(window)
    parse_chunk(chunk)


def head_width(d_model: int, n_heads: int, d_head) -> int:
    """``d_head`` if given, else ``d_model // n_heads`` (which must then divide evenly)."""
    if d_head is None:
        if d_model % n_heads:
            raise ShapeError(f"d_model must be a multiple of n_heads (or pass d_head=); got "
                             f"d_model = {d_model}, n_heads = {n_heads}")
        d_head = d_model // n_heads
    return positive_int("d_head", d_head)


def kv_heads(n_heads: int, n_kv_heads) -> int:
    """``n_kv_heads`` (``n_heads`` if None) as an int >= 1 that divides ``n_heads``."""
    n_kv = n_heads if n_kv_heads is None else positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv:
        raise ShapeError(f"n_heads must be a multiple of n_kv_heads; got n_heads = {n_heads}, n_kv_heads = {n_kv}")
    return n_kv


def head_layout(d_model: int, n_heads, n_kv_heads=None, d_head=None) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, d_head)`` of a multi-head layer of width ``d_model`` (an int
    already checked): MHA when ``n_kv_heads`` is None, GQA/MQA when it divides ``n_heads``."""
    n_heads = positive_int("n_heads", n_heads)
    return n_heads, kv_heads(n_heads, n_kv_heads), head_width(d_model, n_heads, d_head)


def rope_options(rope: bool, d_head: int, rope_base):
    """``rope_base``, checked when RoPE is on (unused, it is kept as given): RoPE rotates
    pairs of features, so ``d_head`` must be even, and the base must be a finite number > 1."""
    if rope and d_head % 2:
        raise ShapeError(f"rope=True needs an even d_head; got d_head = {d_head}")
    if rope:
        check_base(rope_base, "rope_base")
    return rope_base


# --- each call -------------------------------------------------------------------------------
def check_tokens(name: str, shape: tuple, d_model: int) -> None:
    """``shape`` is ``(..., T, d_model)`` (a single head's input: any leading axes)."""
    if len(shape) < 2 or shape[-1] != d_model:
        raise ShapeError(f"{name} must have shape (..., T, d_model) = (..., T, {d_model}); got {fmt_shape(shape)}")


def check_sequences(name: str, shape: tuple, d_model: int, *, empty: bool = False) -> bool:
    """``shape`` is ``(B, T, d_model)`` or ``(T, d_model)`` with ``T >= 1`` (``T >= 0`` with
    ``empty``: a recurrent layer's T = 0 is its state unchanged); returns True for the 2-D form
    (one sequence, which a layer gives back 2-D)."""
    if len(shape) not in (2, 3):
        raise ShapeError(f"{name} must have shape (B, T, d_model) or (T, d_model) with d_model = {d_model}; "
                         f"got {fmt_shape(shape)}")
    if shape[-1] != d_model:
        raise ShapeError(f"{name} must have shape (B, T, d_model) = (..., {d_model}); got {fmt_shape(shape)}")
    if shape[-2] == 0 and not empty:
        raise ShapeError(f"{name} must have T >= 1; got {fmt_shape(shape)}")
    return len(shape) == 2


def check_context(x_shape: tuple, context_shape: tuple) -> None:
    """Cross-attention's ``context`` is given like ``x`` (both 2-D, or both 3-D with x's B);
    each shape already passed :func:`check_sequences`."""
    batch = x_shape[0] if len(x_shape) == 3 else 1
    if len(context_shape) != len(x_shape) or (len(x_shape) == 3 and context_shape[0] != batch):
        raise ShapeError(f"context must have x's batch: x {fmt_shape(x_shape)}, "
                         f"context (B, Tc, d_model) with B = {batch}; got {fmt_shape(context_shape)}")


def check_cache(cache, new_cache: Callable, *, causal, cross: bool = False) -> None:
    """``cache`` is None, or a cache of the kind ``new_cache(batch, max_len)`` makes (same
    class, dtype and per-token shapes) on a causal self-attention call."""
    if cache is None:
        return
    if cross:
        raise ShapeError("cache= is for causal self-attention decoding; got both context= and cache=")
    mine = new_cache(1, 1)  # what this layer's cache holds, per token
    if not isinstance(cache, type(mine)):
        raise ShapeError(f"cache must come from this layer's new_cache(batch, max_len); got {type(cache).__name__}")
    for name, arr in cache.arrays.items():
        want = mine.arrays.get(name)
        if want is None or arr.dtype != want.dtype or \
                tuple(arr.shape[1:-2]) + tuple(arr.shape[-1:]) != tuple(want.shape[1:-2]) + tuple(want.shape[-1:]):
            got = f"{arr.dtype} {fmt_shape(arr.shape)}"
            need = "nothing" if want is None else \
                f"{want.dtype} (B, {', '.join(map(str, tuple(want.shape[1:-2]) + ('max_len',) + tuple(want.shape[-1:])))})"
            raise ShapeError(f"cache {name!r} must be {need} for this layer; got {got} "
                             f"(make the cache with this layer's new_cache(batch, max_len))")
    if cache.window is not None and (mine.window is None or cache.window < mine.window):
        sees = "every earlier key" if mine.window is None else f"the {mine.window} keys before its own"
        raise ShapeError(f"cache keeps the last {cache.window} keys of each sequence, but this layer's query sees "
                         f"{sees} (make the cache with this layer's new_cache(batch, max_len))")
    if not causal:
        raise ShapeError("cache= needs a causal layer (causal=True): a bidirectional layer cannot decode "
                         "one token at a time")


def cache_step(cache, t: int, kv_lengths, q_lengths):
    """For a call on ``cache`` (a :class:`~qkv.nn.Cache`) with ``t`` new rows:
    ``(start, counts, kv_lengths, q_lengths)``.

    ``start`` is where the new tokens go (an int when every sequence is as long, else
    ``(B,)``), ``counts`` how many of the ``t`` rows are real per sequence (``q_lengths``,
    for right-padded prompts), and the lengths to attend with (None when every sequence
    is alike, so that case runs exactly as an unpadded batch)."""
    if kv_lengths is not None:
        raise ShapeError("kv_lengths= is not taken with cache=: the cache knows each sequence's length "
                         "(pass q_lengths= for right-padded new tokens)")
    counts = cache.counts(t, q_lengths)
    held = cache.held  # the tokens before the new ones in what cache.write gives back (lengths, or a window's)
    if held.min() == held.max() and (counts == t).all():
        return (cache.lengths.copy() if cache.ragged else cache.length), counts, None, None
    return cache.lengths.copy(), counts, held + counts, counts


def keys_start(cache):
    """Where a call's new keys begin in what ``cache.write`` gives back: ``held`` (the tokens
    before them), an int when every sequence holds as many, else ``(B,)``."""
    held = cache.held
    return int(held.max()) if held.min() == held.max() else held.copy()


def attention_options(*, causal, align, window, chunk, alibi, scale, gqa: bool,
                      kv_lengths=None, q_lengths=None, cached: bool = False, softcap=None,
                      dropout_p=0.0, dropout_seed=None) -> dict:
    """Keyword arguments of :func:`qkv.attention` / :func:`qkv.attention_backward` for one
    call of a layer with these options; a cached call is aligned bottom-right (each
    sequence's newest query sees its newest key, at its own length)."""
    causal, align = parse_alignment(causal, align)
    if cached:
        align = "bottom_right"
    return dict(causal=causal, align=align, window=window, chunk=chunk, kv_lengths=kv_lengths,
                q_lengths=q_lengths, alibi=alibi, scale=scale, gqa=gqa, softcap=softcap,
                dropout_p=dropout_p, dropout_seed=dropout_seed, method="auto")
