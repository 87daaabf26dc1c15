"""The options of an attention problem, defined once: :data:`OPTIONS` (name, default, kind,
doc), the entry points that take them, and the parsing of the scalar ones (``causal``,
``align``, ``window``, ``chunk``), each checked once, here.

**One table.** :func:`qkv.attention` and :func:`qkv.attention_backward` take
``**options`` and have signatures derived from :data:`OPTIONS` (:func:`signature`); every
call goes through :func:`bind`, which fills the defaults and refuses an unknown keyword by
name. The ring functions, linear attention, ``qkv.torch.attention`` and its operator schema
derive theirs too or are checked against the table; an entry point that does not take an
option says why in :data:`LACKS`, and ``tests/attention/test_options.py`` fails for any public entry
point that neither takes an option nor says why. So a new option is a row here, a rule in
:mod:`qkv.masks` (or the kernels) and a rule in the tests' oracle.

Alignment, for ``Tq = 2`` queries and ``Tk = 5`` keys (1 = may attend, ``causal=True``)::

    align="top_left"               align="bottom_right"
    (i' = i)                       (i' = i + Tk - Tq)
        1 0 0 0 0                      1 1 1 1 0
        1 1 0 0 0                      1 1 1 1 1

``causal="top_left"`` and ``causal="bottom_right"`` are shorthands for ``causal=True`` with
that ``align``.
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass

import numpy as np

from .errors import OptionError, reject_unknown


@dataclass(frozen=True)
class Option:
    """One option of an attention problem.

    ``kind``: ``"mask"`` (which keys a query sees, what is added to its scores, or what is
    done to a score or weight beside the softmax: the :class:`~qkv.masks.MaskSpec` holds it), ``"problem"`` (the rest of the math: scale,
    heads), ``"output"`` (what a forward returns), ``"kernel"`` (how it is computed),
    ``"gradient"`` (a backward's extra input).
    """

    name: str
    default: object
    kind: str
    value: str   # "array", "int", "float", "bool", "str" (adapters type it so), or "causal", "window"
    doc: str


OPTIONS: tuple = (
    Option("mask", None, "mask", "array", "bool, True = may attend; broadcasts to (..., Hq, Tq, Tk)"),
    Option("bias", None, "mask", "array", "float added to the scaled scores, same broadcasting; -inf = may not attend"),
    Option("causal", False, "mask", "causal", "False or True (query i sees keys j <= i'); "
                                              "'top_left'/'bottom_right': causal=True with that align"),
    Option("align", None, "mask", "str", "'top_left' (default: i' = i) or 'bottom_right' (i' = i + Tk_b - Tq_b)"),
    Option("window", None, "mask", "window", "(left, right): query i sees i' - left <= j <= i' + right; n = (n, 0)"),
    Option("chunk", None, "mask", "int", "C: query i sees key j only if i' // C == j // C"),
    Option("kv_lengths", None, "mask", "array", "int (B,): keys >= kv_lengths[b] are never read"),
    Option("q_lengths", None, "mask", "array", "int (B,): query rows >= q_lengths[b] are padding"),
    Option("alibi", None, "mask", "array", "slopes (Hq,) or (B, Hq): adds -slope * |i' - j|"),
    Option("softcap", None, "mask", "float", "c > 0: s = c·tanh(scale·q·k / c), then bias, ALiBi and masks "
                                             "(Gemma 2, flash-attn); None or 0: off"),
    Option("dropout_p", 0.0, "mask", "float", "0 <= p < 1: the weights times keep / (1 - p) after the softmax "
                                              "(lse is the undropped one)"),
    Option("dropout_seed", None, "mask", "int", "the int that, with (batch, head, row, column), draws the "
                                                "keep-mask; needed when dropout_p > 0"),
    Option("scale", None, "problem", "float", "multiplies q kᵀ; default 1/sqrt(D)"),
    Option("gqa", False, "problem", "bool", "Hq % Hkv == 0; query heads h*G .. h*G+G-1 share kv head h"),
    Option("return_lse", False, "output", "bool", "also return lse (..., Hq, Tq)"),
    Option("return_weights", False, "output", "bool", "also return the weights (..., Hq, Tq, Tk)"),
    Option("method", "auto", "kernel", "str", "a registered kernel ('reference', 'flash') or 'auto'"),
)
BY_NAME = {o.name: o for o in OPTIONS}
MASK = tuple(o.name for o in OPTIONS if o.kind == "mask")          # build_spec's keywords
PROBLEM = tuple(o.name for o in OPTIONS if o.kind in ("mask", "problem"))
OUTPUT = tuple(o.name for o in OPTIONS if o.kind == "output")
KERNEL = tuple(o.name for o in OPTIONS if o.kind == "kernel")

# What each public entry point does not take, and why (tests/attention/test_options.py holds every
# entry point to: takes the option, or says here why not).
_LAYER_CALL = "a per-call array: the layer's forward takes kv_lengths= and q_lengths=; a layer has no dense mask or bias"
LACKS = {
    "ring_attention": {
        "q_lengths": "ring attention is self-attention over one sequence: a padded sequence is kv_lengths= "
                     "alone (query rows past it see nothing there)",
        "return_weights": "the ring never holds a (Tq, Tk) array; qkv.attention returns weights",
        "method": "the ring always runs the tiled kernel",
    },
    "linear_attention": {
        **{name: "an option of qkv.attention; linear attention takes causal= and gqa= only"
           for name in ("mask", "bias", "align", "window", "chunk", "kv_lengths", "q_lengths",
                        "alibi", "scale", "return_lse", "return_weights", "method")},
        "softcap": "linear attention has no softmax scores to cap, only feature maps φ(q)·φ(k)",
        "dropout_p": "linear attention never forms the weights that dropout drops",
        "dropout_seed": "linear attention never forms the weights that dropout drops"},
    "layer": {"mask": _LAYER_CALL, "bias": _LAYER_CALL,
              "alibi": "a layer takes alibi=True and makes its own slopes (qkv.positional.alibi_slopes)",
              "return_lse": "a layer returns its output", "return_weights": "forward(return_weights=True)",
              "method": "a layer calls qkv.attention with method='auto'", "gqa": "n_kv_heads= says it",
              "dropout_p": "a layer takes dropout= (its rate, applied in train() mode only)",
              "dropout_seed": "a layer draws each training call's seed from its Generator (rng=) and "
                              "keeps it for the backward"},
}
LACKS["latent"] = {**LACKS["layer"],
                   "alibi": "MLA positions its queries and keys by decoupled RoPE (d_rope=), not ALiBi",
                   "scale": "MLA's scale is 1/sqrt(d_head + d_rope), its decoupled RoPE part included",
                   "gqa": "every head reads the one shared latent: there are no kv heads to group"}
LACKS["self_attention"] = {
    **{name: "the texts' single head is the equation and nothing more: one sequence, causal= at most; "
             "qkv.nn.MultiHeadAttention has every option" for name in MASK if name != "causal"},
    "scale": "the texts' 1/sqrt(d_k), as the equation has it",
    "gqa": "one head: nothing to group"}


def names(*kinds: str, lacking: str | None = None) -> tuple:
    """The options of these kinds, in the table's order, less those ``LACKS[lacking]`` names."""
    skip = LACKS.get(lacking, {})
    return tuple(o.name for o in OPTIONS if o.kind in kinds and o.name not in skip)


def bind(where: str, given: dict, takes: tuple, why: dict | None = None) -> dict:
    """``given`` keywords with every option of ``takes`` filled with its default; an unknown
    keyword is an OptionError naming qkv's name for it (or ``why`` it is not taken here)."""
    unknown = {k: v for k, v in given.items() if k not in takes}
    if unknown:
        reject_unknown(where, unknown, list(takes), why)
    return {name: given.get(name, BY_NAME[name].default) for name in takes}


def signature(positional: tuple, takes: tuple, before: tuple = ()) -> inspect.Signature:
    """``(positional..., *, before..., takes...)``: the signature an entry point shows, derived
    from :data:`OPTIONS` (``before``: its own keyword parameters, as ``(name, default)``)."""
    params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in positional]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in before]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=BY_NAME[n].default) for n in takes]
    return inspect.Signature(params)

ALIGNS = ("top_left", "bottom_right")
# No array has this many positions: a window side this wide limits nothing, and a chunk this
# long splits positions as any longer one does, so both saturate here (int64 and a torch
# schema's int hold it; window=2**63 or chunk=10**30 would overflow them).
FAR = 2 ** 62


def parse_alignment(causal, align=None) -> tuple[bool, str]:
    """``(causal, align)`` from the user's ``causal`` and ``align``.

    ``causal`` is ``False``/``None``, ``True``, or an alignment name (the shorthand);
    anything else (``1``, ``0.0``, ``"yes"``) is refused rather than read as a bool.

    >>> parse_alignment("bottom_right")
    (True, 'bottom_right')
    >>> parse_alignment(False, "bottom_right")
    (False, 'bottom_right')
    """
    if align is not None and (not isinstance(align, str) or align not in ALIGNS):
        raise OptionError(f"align must be 'top_left' or 'bottom_right' (or None: top-left); got {align!r}")
    if causal is None or (isinstance(causal, (bool, np.bool_)) and not causal):
        return False, align or "top_left"
    if isinstance(causal, (bool, np.bool_)):
        return True, align or "top_left"
    if isinstance(causal, str) and causal in ALIGNS:
        if align is not None and align != causal:
            raise OptionError(f"causal={causal!r} conflicts with align={align!r}: pass causal=True "
                             f"and one align")
        return True, causal
    raise OptionError(f"causal must be False, True, 'top_left' or 'bottom_right'; got {causal!r}")


def parse_window(window) -> tuple:
    """``None`` -> (None, None); ``n`` -> (n, 0); ``(left, right)`` with ints >= 0 or None
    (a side of :data:`FAR` or more is None)."""
    if window is None:
        return None, None
    if isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_)):
        window = (int(window), 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise OptionError(
            f"window must be an int n (meaning (n, 0)) or a pair (left, right) of ints >= 0 "
            f"or None; got {window!r}")
    sides = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            sides.append(None)
        elif isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) and w >= 0:
            sides.append(None if w >= FAR else int(w))
        else:
            raise OptionError(f"window {side} must be an int >= 0 or None; got {w!r} in window={window!r}")
    return tuple(sides)


def parse_chunk(chunk) -> int | None:
    """``None`` or an int ``C >= 1``: query i' sees key j only if ``⌊i'/C⌋ = ⌊j/C⌋``."""
    if chunk is None:
        return None
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise OptionError(f"chunk must be an int >= 1 (keys per chunk) or None; got {chunk!r}")
    return min(int(chunk), FAR)


def parse_scale(scale) -> float | None:
    """``None`` (1/sqrt(D), decided with the shapes) or a finite real number."""
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise OptionError(f"scale must be a finite real number (default 1/sqrt(D)); got {scale!r}")
    return float(scale)


def parse_flag(name: str, value) -> bool:
    """``True`` or ``False`` (NumPy's bools too); anything else (1, "yes") is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def parse_softcap(softcap) -> float | None:
    """``None`` (or 0: off) or a finite real ``c > 0``: scores ``c·tanh(x / c)``."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real) or \
            not math.isfinite(softcap) or softcap < 0:
        raise OptionError(f"softcap must be a finite real number > 0 (None or 0: off); got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def parse_dropout(dropout_p, dropout_seed) -> tuple[float, int]:
    """``(p, seed)``: ``0 <= p < 1`` and, when ``p > 0``, an int seed (taken mod 2**64; 0 when
    ``p = 0``, where no mask is drawn)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real) or \
            not 0 <= dropout_p < 1:  # NaN fails both comparisons
        raise OptionError(f"dropout_p must be a real number in [0, 1); got {dropout_p!r}")
    if dropout_seed is not None and (isinstance(dropout_seed, (bool, np.bool_))
                                     or not isinstance(dropout_seed, (int, np.integer))):
        raise OptionError(f"dropout_seed must be an int (or None with dropout_p = 0); got {dropout_seed!r}")
    if dropout_p == 0:
        return 0.0, 0
    if dropout_seed is None:
        raise OptionError(f"dropout_p={dropout_p!r} needs dropout_seed= (an int): the keep-mask is a function "
                          "of it, and the backward draws the same mask from it")
    return float(dropout_p), int(dropout_seed) % 2 ** 64
