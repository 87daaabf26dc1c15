"""ShapeError, OptionError and the checks that name the argument, what was expected and what came.

Every bad shape or dtype anywhere in qkv raises :class:`ShapeError`, a ``ValueError``, and
every bad option value or unknown keyword :class:`OptionError`, a subclass of it (so code
that catches ShapeError still catches both), with a message of the form::

    k must have shape (B, Hkv, Tk, D) = (2, 4, 16, 64); got (2, 4, 16, 32)
    window left must be an int >= 0 or None; got -1 in window=(-1, 0)

so that the first line of a traceback is enough to fix the call.
"""
from __future__ import annotations

import numbers

import numpy as np


class ShapeError(ValueError):
    """A shape or dtype that qkv cannot accept; the message names the argument, what was
    expected and what came."""


class OptionError(ShapeError):
    """An option's value that qkv cannot accept, options that conflict, or a keyword qkv does
    not take. A ShapeError too (code written before it existed catches it as one)."""


def fmt_shape(shape) -> str:
    """``(2, 3)`` for a tuple, ``(7,)`` for a 1-tuple, ``()`` for a scalar."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join(str(s) for s in shape) + ")"


def as_array(name: str, x) -> np.ndarray:
    """``np.asarray(x)``, with a ShapeError naming ``name`` where NumPy makes no array of it
    (a ragged nested list, say).

    >>> as_array("mask", [[True, False], [True]])
    Traceback (most recent call last):
    ...
    qkv.errors.ShapeError: mask must be a rectangular array; got a list that NumPy cannot make one of ...
    """
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as err:
        raise ShapeError(
            f"{name} must be a rectangular array; got a {type(x).__name__} that NumPy cannot make one of ({err})"
        ) from None


def as_float_array(name: str, x) -> np.ndarray:
    """``x`` as an ndarray of a real floating dtype (float16/32/64); ints and complex are refused.

    Integer inputs are refused rather than converted: ``attention(ids, ids, ids)`` on
    token ids is almost always a bug, and a silent float cast would hide it.
    """
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple, numbers.Number)):
            x = as_array(name, x)
        else:
            raise ShapeError(f"{name} must be a NumPy array; got {type(x).__name__}")
    if x.dtype.kind != "f" or x.dtype.itemsize > 8:
        raise ShapeError(
            f"{name} must be a real floating array (float16, float32 or float64); got dtype {x.dtype}"
        )
    return x


# Keyword arguments people bring from torch's scaled_dot_product_attention, flash-attn and
# Hugging Face, and what qkv calls the same thing.
FOREIGN_OPTIONS = {
    "is_causal": "causal=True (top-left, as torch), or causal='bottom_right'",
    "attn_mask": "mask= (bool, True = may attend) or bias= (float, added to the scaled scores)",
    "attention_mask": "mask= (bool, True = may attend) or kv_lengths= (real keys per batch row)",
    "key_padding_mask": "kv_lengths= (real keys per batch row) or mask=",
    "dropout": "dropout_p= (with dropout_seed=, an int: the keep-mask is a function of it)",
    "attn_logit_softcapping": "softcap=",
    "logit_softcapping": "softcap=",
    "enable_gqa": "gqa=True",
    "softmax_scale": "scale=",
    "sm_scale": "scale=",
    "window_size": "window=(left, right)",
    "sliding_window": "window=",
    "alibi_slopes": "alibi=",
    "need_weights": "return_weights=True",
    "return_attn_probs": "return_weights=True",
    "return_softmax_lse": "return_lse=True",
}


def reject_options(func, unknown: dict, why: dict | None = None) -> None:
    """A ShapeError naming each keyword ``func`` does not take (its ``**unknown``), with qkv's
    own name where it is a familiar one from torch or flash-attn (or ``why[name]``, where the
    caller says why it has no such option), and ``func``'s options.

    >>> def attention(q, *, mask=None, causal=False, **unknown):
    ...     reject_options(attention, unknown)
    >>> attention(1, is_causal=True)
    Traceback (most recent call last):
    ...
    qkv.errors.OptionError: attention got an unknown keyword argument is_causal= (qkv's name: causal=True ...
    """
    if not unknown:
        return
    import inspect

    params = inspect.signature(func).parameters.values()
    reject_unknown(func.__name__, unknown, [p.name for p in params if p.kind is p.KEYWORD_ONLY], why)


def reject_unknown(where: str, unknown, known, why: dict | None = None) -> None:
    """The OptionError of :func:`reject_options` for an entry point named ``where`` whose
    options are ``known`` (names)."""
    if not unknown:
        return
    why = why or {}
    named = [f"{k}= ({why[k]})" if k in why else
             f"{k}= (qkv's name: {FOREIGN_OPTIONS[k]})" if k in FOREIGN_OPTIONS else f"{k}=" for k in unknown]
    many = "unknown keyword arguments" if len(named) > 1 else "an unknown keyword argument"
    raise OptionError(f"{where} got {many} {'; '.join(named)}; its options are {', '.join(known)}")


def positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= minimum (bools refused), or a ShapeError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise OptionError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


def expect_ndim(name: str, x: np.ndarray, at_least: int, layout: str) -> None:
    """Raise unless ``x.ndim >= at_least``; ``layout`` is the expected layout, e.g. ``(..., T, D)``."""
    if x.ndim < at_least:
        raise ShapeError(
            f"{name} must have at least {at_least} dimensions {layout}; got shape {fmt_shape(x.shape)}"
        )


def broadcast_or_raise(what: str, shapes: dict[str, tuple]) -> tuple:
    """np.broadcast_shapes over named shapes, naming them all when they do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        listing = ", ".join(f"{n} {fmt_shape(s)}" for n, s in shapes.items())
        raise ShapeError(f"{what} must broadcast together; got {listing}") from None


def broadcasts_to(name: str, shape: tuple, target: tuple, target_names: str) -> None:
    """Raise unless an array of ``shape`` broadcasts to ``target`` without growing it."""
    ok = len(shape) <= len(target)
    if ok:
        for s, t in zip(reversed(shape), reversed(target)):
            if s != 1 and s != t:
                ok = False
                break
    if not ok:
        raise ShapeError(
            f"{name} must broadcast to {target_names} = {fmt_shape(target)}; got {fmt_shape(shape)}"
        )
