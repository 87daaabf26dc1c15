"""The scalar options of :func:`qkv.attention` that say which keys a query may see:
``causal``, ``align``, ``window`` and ``chunk``, each checked once, here.

Alignment, for ``Tq = 2`` queries and ``Tk = 5`` keys (1 = may attend, ``causal=True``)::

    align="top_left"               align="bottom_right"
    (i' = i)                       (i' = i + Tk - Tq)
        1 0 0 0 0                      1 1 1 1 0
        1 1 0 0 0                      1 1 1 1 1

``causal="top_left"`` and ``causal="bottom_right"`` are shorthands for ``causal=True`` with
that ``align``.
"""
from __future__ import annotations

import numpy as np

from .errors import OptionError

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
