"""Keep the pages of freed arrays mapped, so that a training loop does not fault them in again
every step.

A NumPy training step allocates and frees many arrays of a few MiB: activations, their
gradients, the temporaries of element-wise expressions. glibc's ``malloc`` serves a block
above its mmap threshold (128 KiB at first, raised as such blocks are freed) with a fresh
``mmap`` and gives the top of its heap back to the system once more than a trim threshold of
it is free. Either way the next step's arrays land on pages the kernel must map and zero
again: one minor page fault every 4 KiB. Measured on a 2-core Xeon (a virtual machine, where
a fault is dear), a width-128 Gated DeltaNet MQAR step took about 390 000 faults in 40 steps
and a quarter of its time in them; with both thresholds raised, 70 000 (most of them the
first step's) and the step about 25% faster. ``np.exp(-np.abs(a))`` on a ``(16, 256, 128)``
float32 array: 4.2 ms before, 1.1-1.4 ms after (0.35 ms for ``exp`` alone).

The cost is memory: the heap keeps up to 1 GiB of freed memory for later arrays instead of
returning it between steps, as a caching allocator does. Blocks of 32 MiB and more (the mmap
threshold, glibc's largest) are still mapped and unmapped each time.

This is a setting of the whole process, so importing qkv never makes it: the ``qkv``
command's training, sampling and experiment subcommands do, and the MQAR experiment's worker
processes; a script that trains can call :func:`keep_freed_memory` itself (or set glibc's
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` before Python starts). Results do
not change: where an array lies does not change what NumPy computes (tested).
"""
from __future__ import annotations

import ctypes
import platform
import sys

M_TRIM_THRESHOLD = -1      # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX / 2 on 64-bit): blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30   # free memory the heap keeps before it gives any back


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns True when both were set; False (and nothing changed) on a C library other than
    glibc, where ``mallopt`` is missing or ignores them.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def available_memory() -> int | None:
    """Bytes of memory this machine can give a new allocation without swapping: Linux's
    ``MemAvailable``, else the free physical pages (``os.sysconf``); None where neither is known.
    (Read by the dense attention paths and the training runs before they allocate.)"""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
