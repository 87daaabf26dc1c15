"""Where the layers' fused elementwise passes come from: :mod:`qkv.nn.fused` (numba), or nowhere.

The ``fast`` extra (numba) turns a LayerNorm, a GELU, the softmax + cross-entropy or AdamW's
update, which NumPy runs as several passes over memory with a temporary each, into one
compiled loop. :func:`compiled` gives that module where numba is installed and ``QKV_JIT=0``
is not set (looked for once, at the first call, never on ``import qkv``), and only for
arrays it can take (C-contiguous float32 or float64); otherwise None and the caller runs
its NumPy passes, which compute the same formulas.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from .. import jit, threads
from . import products

MODULE = "qkv.nn.fused"


def enabled() -> bool:
    """numba is installed and ``QKV_JIT=0`` is not set."""
    return jit.enabled()


def module() -> ModuleType | None:
    """:mod:`qkv.nn.fused`, imported at the first call, or None (no numba, or ``QKV_JIT=0``)."""
    return jit.load(MODULE)


def compiled(*arrays: np.ndarray) -> ModuleType | None:
    """The fused module if every array is a C-contiguous float32/float64 array of one dtype, else None."""
    mod = module()
    if mod is None:
        return None
    dtype = arrays[0].dtype
    for a in arrays:
        if a.dtype != dtype or dtype not in (np.float32, np.float64) or not a.flags.c_contiguous:
            return None
    return mod


PARALLEL_MIN = 1 << 20  # elements below which a fused pass stays on the calling thread (see parallel)


def parallel(jobs: list, sizes: list) -> None:
    """Call every ``job()`` (numba passes that release the GIL) on qkv's kernel threads
    (:func:`qkv.get_num_threads`), in groups balanced by ``sizes``; on the calling thread
    when there is one thread or less than :data:`PARALLEL_MIN` elements in all. Each job
    writes its own arrays, so the bits never depend on the threads. (nanoGPT's CPU recipe,
    under the threshold throughout: handing its GELU, LayerNorm and AdamW passes to a second
    thread right after OpenBLAS's threads ran a product made the step 1.6 ms slower.)"""
    n = threads.get_num_threads()
    if n <= 1 or len(jobs) <= 1 or sum(sizes) < PARALLEL_MIN:
        for job in jobs:
            job()
        return
    groups, loads = [[] for _ in range(n)], [0] * n
    for i in sorted(range(len(jobs)), key=lambda i: -sizes[i]):  # largest first, to the lightest group
        g = loads.index(min(loads))
        groups[g].append(jobs[i])
        loads[g] += sizes[i]
    list(threads.pool(n).map(lambda group: [job() for job in group], [g for g in groups if g]))


def chunked(call, size: int) -> None:
    """``call(a, b)`` over ``[0, size)`` cut in one contiguous piece per kernel thread (see
    :func:`parallel`): for element-wise passes."""
    n = max(1, min(threads.get_num_threads(), size // (PARALLEL_MIN // 2) or 1))
    cuts = [size * i // n for i in range(n + 1)]
    parallel([(lambda a=a, b=b: call(a, b)) for a, b in zip(cuts[:-1], cuts[1:])],
             [b - a for a, b in zip(cuts[:-1], cuts[1:])])


def passes(serial, in_parts, *arrays: np.ndarray) -> None:
    """An element-wise pass over flat ``arrays``: ``in_parts(*arrays, n)`` on ``n`` of numba's
    threads where the layers' products run there too (:func:`qkv.nn.products.threads_for`: one
    pool, so the pass finds its threads free), else ``serial`` over :func:`chunked` pieces."""
    n = products.threads_for(arrays[0].size, products.PASS_MIN)
    if n > 1:
        with threads.numba_threads(n) as nt:
            in_parts(*arrays, nt)
        return
    chunked(lambda a, b: serial(*(x[a:b] for x in arrays)), arrays[0].size)
