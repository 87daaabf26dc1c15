"""A work unit's rows: the heads ``[a, b)`` of an input's ``B·H`` and its positions ``[t0, t1)``,
C-ordered, whatever the layout the input came in.

The chunked forms cut ``(B, H, T, ·)`` inputs into units of whole heads (and a long sequence
into segments) and run a unit at a time on a kernel thread. An input in C order gives each
unit a view; any other (a transposed view, or a broadcast one: Mamba-2's B and C, one group's
shared by 16 heads, or a q or k repeated for grouped value heads) is gathered unit by unit
into a work array of the thread's, never copied whole (16 copies of the group, and its checks
16 times, took 20 ms of a 110 ms SSD call at T = 8192). A unit's rows are the same numbers
either way, so the results are the same bits.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def rows(x: np.ndarray, a: int, b: int, t0: int, t1: int, work: Callable[[tuple, np.dtype], np.ndarray]) -> np.ndarray:
    """``x (B, H, T, ·)``'s heads ``[a, b)`` (of ``B·H``) at positions ``[t0, t1)``: a C-ordered
    ``(b - a, t1 - t0, ·)`` view where x is C-ordered, else gathered into ``work(shape, dtype)``."""
    H = x.shape[1]
    if x.flags.c_contiguous:
        return x.reshape((x.shape[0] * H,) + x.shape[2:])[a:b, t0:t1]
    out = work((b - a, t1 - t0) + x.shape[3:], x.dtype)
    for j, i in enumerate(range(a, b)):
        out[j] = x[i // H, i % H, t0:t1]
    return out
