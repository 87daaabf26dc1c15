"""Scratch arrays of the row kernels, one set a thread, reused from call to call.

A row kernel's work unit makes the same few temporaries every time (a block of scores, dP,
the gradient products), each 64 KiB to a few MiB. Left to ``malloc`` each is a fresh
allocation: glibc serves blocks past its mmap threshold (128 KiB until something frees a
bigger block) with ``mmap`` and hands them back at ``free``, and trims a heap whose free top
passes its trim threshold, so the next unit page-faults the same memory in again. Measured
(one thread, AVX-512, a NumPy-only process, B=1 H=8 T=256 D=16): the row kernel's backward
took 2.7 ms that way against 1.2 ms once the thresholds had been raised, which importing
torch or numba happens to do; the pool's worker threads, each with an arena of its own, hit
the same. Here a temporary is a view of a buffer the thread keeps (grown to the largest
block it has needed), so a unit allocates nothing large.

A buffer lives as long as its thread: the calling thread's and each kernel thread's, at most
a few MiB each (a unit is :data:`qkv.kernels.rows.UNIT_ENTRIES`-sized, or one head's block).
What :func:`take` gives must not leave the kernel: the next unit on the thread overwrites it.
"""
from __future__ import annotations

import math
import threading

import numpy as np

_local = threading.local()


def take(name: str, shape: tuple, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous ``shape`` array: this thread's buffer ``name`` (grown
    where too small). Two names never share memory; one name is one array at a time."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    size = math.prod(shape)
    buf = bufs.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = bufs[name] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


def matmul(a: np.ndarray, b: np.ndarray, name: str) -> np.ndarray:
    """``a @ b`` into buffer ``name`` (``a`` and ``b`` with the same batch axes)."""
    return np.matmul(a, b, out=take(name, a.shape[:-1] + b.shape[-1:]))


def zeros(name: str, shape: tuple) -> np.ndarray:
    """Buffer ``name`` as float32 zeros."""
    x = take(name, shape)
    x.fill(0)
    return x


def transposed(x: np.ndarray, name: str) -> np.ndarray:
    """``x (..., T, D)`` as a contiguous ``(..., D, T)`` copy in buffer ``name``."""
    t = np.swapaxes(x, -1, -2)
    out = take(name, t.shape, x.dtype)
    np.copyto(out, t)
    return out
