"""Scratch arrays of the row kernels: one set a thread, shared by the units and blocks of a call.

A row kernel's work unit makes the same few temporaries for each block of rows (the block's
scores, dP, the gradient products), 64 KiB to a few MiB each. Here a temporary is a view of
a buffer its thread keeps while it runs its share of a call (:func:`take`, grown to the
largest block it needs) and lets go of at the end (:func:`release`, called by
:func:`qkv.kernels.rows.kernel._run`): a call allocates each once, not once a block, and keeps
nothing after it (a training step's peak memory stays what it was).

What makes allocation cheap between calls is glibc's dynamic mmap threshold: until a process
frees a block bigger than 128 KiB, glibc serves such blocks with ``mmap`` and returns them
at ``free``, so each call page-faulted its buffers in anew. Measured (one thread, AVX-512, a
NumPy-only process, the row kernel's backward): B=1 H=8 T=256 D=16 2.7 ms against 1.2 ms, B=12
H=4 T=64 D=32 2.2 against 0.63, once the threshold had been raised, which importing torch or
numba happens to do. The first buffer taken frees one untouched 8 MiB block, which raises
it the same way (:func:`_raise_mmap_threshold`; not at ``import qkv``: only a process that
runs a row kernel pays for it).

What :func:`take` gives must not leave the kernel: the next block on the thread overwrites it.
"""
from __future__ import annotations

import math
import threading

import numpy as np

_local = threading.local()
_primed = []  # non-empty once _raise_mmap_threshold ran


def _raise_mmap_threshold() -> None:
    """Free one untouched 8 MiB block: glibc then serves blocks up to that size from its heap
    and keeps freed memory there (its dynamic mmap threshold, as any process that freed a big
    array, or imported torch or numba, already has). No memory is touched or kept."""
    np.empty(1 << 23, np.uint8)
    _primed.append(True)


def take(name: str, shape: tuple, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous ``shape`` array: this thread's buffer ``name`` (grown
    where too small). Two names never share memory; one name is one array at a time."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:                       # this thread's first buffer
        if not _primed:
            _raise_mmap_threshold()
        bufs = _local.bufs = {}
    size = math.prod(shape)
    buf = bufs.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = bufs[name] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


def release() -> None:
    """Let go of this thread's buffers (the end of a call's share of units)."""
    _local.bufs = {}


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
