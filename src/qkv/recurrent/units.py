"""A work unit's rows: the heads ``[a, b)`` of an input's ``B·H`` and its positions ``[t0, t1)``,
each head C-ordered, whatever the layout the input came in.

The chunked forms cut ``(B, H, T, ·)`` inputs into units of whole heads (and a long sequence
into segments) and run a unit at a time on a kernel thread. An input in C order gives each
unit a view; any other (a transposed view, or a broadcast one: Mamba-2's B and C, one group's
shared by 16 heads, or a q or k repeated for grouped value heads) is gathered unit by unit
into a work array of the thread's, never copied whole (16 copies of the group, and its checks
16 times, took 20 ms of a 110 ms SSD call at T = 8192). A unit's rows are the same numbers
either way, so the results are the same bits. A head that every head of the call reads (a
broadcast at stride 0: Mamba-2's B and C with one group) is copied once a call
(:func:`shared_once`), and a unit of one batch row reads that copy in place, broadcast over its
heads (stride 0: its caller, the decay forward, reads heads so). Gathered once a head, it took
1.4 of a 13 ms SSD call at T = 2048, 16 heads of 64, one thread; once a unit, 2.7 ms (169 µs a
gather); once a call, 0.4. (Read in place as strided rows of the in-projection's output, the
chunk loop's products took longer than the gathers: 18 against 13 ms.)
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def rows(x: np.ndarray, a: int, b: int, t0: int, t1: int,
         work: Callable[[tuple, np.dtype], np.ndarray]) -> np.ndarray:
    """``x (B, H, T, ·)``'s heads ``[a, b)`` (of ``B·H``) at positions ``[t0, t1)``: a C-ordered
    ``(b - a, t1 - t0, ·)`` view where x is C-ordered, else gathered into ``work(shape, dtype)``;
    heads of one batch row broadcast from one C-ordered head (stride 0: :func:`shared_once`'s copy of
    Mamba-2's B and C, one group) read it in place, broadcast over the unit's heads."""
    H = x.shape[1]
    if x.flags.c_contiguous:
        return x.reshape((x.shape[0] * H,) + x.shape[2:])[a:b, t0:t1]
    if b > a and a // H == (b - 1) // H and x.strides[1] == 0 and (head := x[a // H, 0, t0:t1]).flags.c_contiguous:
        return np.broadcast_to(head, (b - a,) + head.shape)            # shared_once's copy, read in place
    out = work((b - a, t1 - t0) + x.shape[3:], x.dtype)
    for j, i in enumerate(range(a, b)):
        out[j] = x[i // H, i % H, t0:t1]
    return out


def shared_once(x: np.ndarray) -> np.ndarray:
    """``x (B, H, T, ·)`` broadcast over its heads (stride 0, H > 1): its one head a batch row copied once,
    C-ordered, and broadcast again, so that :func:`rows` hands every unit a view of that copy (the same
    numbers, in memory of its own, as the units' gathers were: a q and k broadcast from one array do not
    become one operand); any other x as it is."""
    if x.ndim != 4 or x.shape[1] < 2 or x.strides[1] != 0:
        return x
    return np.broadcast_to(x[:, :1].copy(), x.shape)
