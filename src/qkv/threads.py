"""How many threads qkv's kernels use, and BLAS held to one thread while they run.

The tiled kernels and the encoder bring their own parallelism: Python threads over tiles or
batches (NumPy releases the GIL in BLAS and ufuncs). A multi-threaded BLAS underneath would
only add threads that spin between the many mid-sized products and take the cores the
element-wise passes need, so while any of them runs BLAS is held to one thread. The hold is
counted under a lock: the first concurrent caller sets it, the last one restores what it
found, and these two may be different threads.

It also makes results reproducible: how OpenBLAS splits a product over its threads can
change the rounding (its Haswell kernels do), so a kernel's bits would depend on the BLAS
thread count of the moment. threadpoolctl 3.8 lets only one thread, the first to set it,
change a pthreads OpenBLAS's process-wide pool and silently skips sets from any other; a
hold taken from a worker thread then did nothing. The counted hold is itself the arbiter
between qkv's callers, so it drops that claim around each change it makes (see
:func:`_set_blas`). With an OpenMP-threaded BLAS the limit is per thread; that build was
not available to test here. Where every loaded BLAS is a pthreads OpenBLAS (NumPy's wheels)
the hold calls its ``openblas_set_num_threads`` directly: 1.7 µs a hold and release against
threadpoolctl's 10, a cost every kernel call pays.

**What a result's bits depend on**: the inputs, the options and the thread count, never on
earlier calls, the process or timing (``tests/attention/test_same_bits.py`` runs every kernel in fresh
processes after shuffled histories). The reference, the stacked kernel, both row kernels and
the tiled kernel's forward give the same bits on every thread count of this module; the
tiled backward one set of bits per count (each thread adds dQ in a buffer of its own). The
dense kernels' products (the reference, the stacked kernel) run on BLAS's own threads as the
process set them (``OPENBLAS_NUM_THREADS``), and with OpenBLAS's Haswell kernels a product
large enough to be split rounds differently on one thread and two: that count is a knob too.
The layers' products inside :func:`qkv.nn.products.one_pool` (a GPT of attention blocks) run
on numba's threads in pieces that keep one BLAS thread's bits, whatever either count.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from .errors import ShapeError

_lock = threading.Lock()
_state = {"threads": None, "pool": None, "pool_size": 0}
_blas = {"users": 0, "limiter": None, "ctl": None, "pools": None}
_here = contextvars.ContextVar("qkv_kernel_threads", default=None)  # kernel_threads(n) in force
_pooled = contextvars.ContextVar("qkv_pool_threads", default=None)   # kernel_threads(n, pools_only=True)


def _check(n) -> int | None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
        raise ShapeError(f"num_threads must be an int >= 1 or None; got {n!r}")
    return None if n is None else int(n)


def set_num_threads(n: int | None) -> None:
    """Threads the tiled kernels use (``None``: ``os.cpu_count()``, the default). Process-wide:
    the user's default; :func:`kernel_threads` overrides it for one thread's calls."""
    _state["threads"] = _check(n)


@functools.cache
def _cpus() -> int:
    """``os.cpu_count()``, read once: it reads /sys on each call (7.5 µs on this project's
    machines, a tenth of a small attention call's whole fixed cost)."""
    return os.cpu_count() or 1


def get_num_threads(compiled: bool = False) -> int:
    """Threads the tiled kernels called from here use now. ``compiled=True``: for a kernel whose
    threads are numba's own (:mod:`qkv.kernels.rows.fused`), which a ``pools_only`` limit
    leaves alone."""
    n = _here.get() or _state["threads"] or _cpus()
    pooled = None if compiled else _pooled.get()
    return n if pooled is None else min(n, pooled)


@contextmanager
def kernel_threads(n: int, pools_only: bool = False):
    """``with kernel_threads(n):`` the tiled kernels called inside the block, from this thread
    (this context), use ``n`` threads; other threads keep the process-wide default.

    For code that brings its own parallelism (the encoder runs one batch a thread) without
    touching what other callers of :func:`qkv.attention` get. ``pools_only=True`` limits the
    kernels that run on Python threads (qkv's pool) and not those on numba's threads.
    """
    var = _pooled if pools_only else _here
    token = var.set(_check(n))
    try:
        yield
    finally:
        var.reset(token)


def one_thread_if(serial: bool, pools_only: bool = False):
    """``kernel_threads(1, pools_only)`` where ``serial``, else a context that changes nothing:
    for callers that know a kernel thread would find its core taken (a layer right after
    BLAS's threads, torch's OpenMP workers spinning on)."""
    return kernel_threads(1, pools_only) if serial else contextlib.nullcontext()


def pool(n: int) -> ThreadPoolExecutor:
    """The shared worker pool, grown to at least ``n`` threads.

    Growing replaces the pool without shutting the old one down: a kernel on another thread
    may hold it between this call and its ``map``. Its threads end once it is collected.
    """
    with _lock:
        if _state["pool_size"] < n:
            _state["pool"] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="qkv")
            _state["pool_size"] = n
        return _state["pool"]


def _controller():
    """threadpoolctl's view of the loaded libraries, renewed when modules were imported since
    (a BLAS loaded later, torch's say, must be held too)."""
    import threadpoolctl

    cached = getattr(threadpoolctl, "get_cached_controller", None)  # threadpoolctl >= 3.8
    return cached() if cached is not None else threadpoolctl.ThreadpoolController()


def blas_libraries() -> list[str]:
    """The file paths of the BLAS libraries loaded in this process (threadpoolctl's view): where
    a kernel that calls a BLAS function directly (:mod:`qkv.kernels.rows.fused`) looks for it."""
    return [lib.filepath for lib in _controller().lib_controllers if lib.user_api == "blas"]


@functools.cache
def blas_core() -> str:
    """The CPU kernels NumPy's BLAS runs, as OpenBLAS names its core (``"skylakex"``,
    ``"haswell"``, ...: lower case; ``OPENBLAS_CORETYPE`` changes it), or ``""`` where NumPy's
    BLAS is not OpenBLAS or does not say. Read once a process."""
    where = os.path.dirname(os.path.dirname(np.__file__))
    for lib in _controller().lib_controllers:
        if lib.internal_api == "openblas" and os.path.basename(os.path.dirname(lib.filepath)) == "numpy.libs" \
                and lib.filepath.startswith(where):
            return str(getattr(lib, "architecture", "") or "").lower()
    return ""


SMALL_PRODUCT_CORES = ("skylakex", "cooperlake", "sapphirerapids")  # OpenBLAS cores with small-matrix sgemm kernels


def small_products() -> bool:
    """True where NumPy's OpenBLAS runs one of :data:`SMALL_PRODUCT_CORES` (its AVX-512 cores): those take a
    product of at most 10^6 multiply-adds into small-matrix kernels, faster than their general one for
    ``A B`` and ``Aᵀ B`` and slower for ``A Bᵀ``, so a kernel may cut a product or lay out an operand for them."""
    return blas_core() in SMALL_PRODUCT_CORES


def _drop_claim() -> None:
    """Forget which thread threadpoolctl (>= 3.8) lets set OpenBLAS's pool size, if any."""
    import threadpoolctl

    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


def _set_blas(change):
    """Run ``change()`` (a threadpoolctl limit or restore) so that it takes effect from
    whichever thread calls it: no threadpoolctl claim stands before it, and none after."""
    _drop_claim()
    try:
        return change()
    finally:
        _drop_claim()


def _openblas_pools(ctl) -> tuple | None:
    """``((get, set), ...)``: the thread-count functions of each loaded BLAS where every one is a
    pthreads OpenBLAS (one process-wide pool each: what the hold sets, as threadpoolctl would,
    in a microsecond instead of its ten); None where another BLAS is loaded. Kept per
    threadpoolctl controller (renewed when modules were imported)."""
    if _blas.get("ctl") is not ctl:
        _blas["ctl"], _blas["pools"] = ctl, _find_pools(ctl)
    return _blas["pools"]


def _find_pools(ctl) -> tuple | None:
    import ctypes

    pools = []
    for lib in ctl.lib_controllers:
        if lib.user_api != "blas":
            continue
        if lib.internal_api != "openblas" or getattr(lib, "threading_layer", None) != "pthreads":
            return None
        try:
            dll = ctypes.CDLL(lib.filepath, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)  # the loaded one only
        except OSError:
            return None
        names = [(f"{p}openblas_get_num_threads{x}", f"{p}openblas_set_num_threads{x}")
                 for p in ("", "scipy_") for x in ("", "64_", "_64")]
        found = [(getattr(dll, g), getattr(dll, st)) for g, st in names if hasattr(dll, g) and hasattr(dll, st)]
        if not found:
            return None
        get, set_ = found[0]
        get.restype, get.argtypes, set_.restype, set_.argtypes = ctypes.c_int, [], None, [ctypes.c_int]
        pools.append((get, set_))
    return tuple(pools)


def hold_blas() -> None:
    """Hold BLAS to one thread until the matching :func:`release_blas` (counted; any thread)."""
    with _lock:
        if _blas["users"] == 0:
            ctl = _controller()
            pools = _openblas_pools(ctl)
            if pools is not None:
                _blas["limiter"] = [(set_, get()) for get, set_ in pools]
                for set_, _ in _blas["limiter"]:
                    set_(1)
            else:
                _blas["limiter"] = _set_blas(lambda: ctl.limit(limits=1, user_api="blas"))
        _blas["users"] += 1


def release_blas() -> None:
    """End one :func:`hold_blas` (from any thread); the last one restores BLAS as it was found."""
    with _lock:
        _blas["users"] -= 1
        if _blas["users"] == 0:
            found = _blas["limiter"]
            if isinstance(found, list):
                for set_, n in found:
                    set_(n)
            else:
                _set_blas(found.restore_original_limits)
            _blas["limiter"] = None


@contextmanager
def blas_one_thread():
    """``with blas_one_thread(): ...`` holds BLAS to one thread for the block."""
    hold_blas()
    try:
        yield
    finally:
        release_blas()


@contextmanager
def numba_threads(n: int):
    """``with numba_threads(n):`` numba's parallel loops called from this thread inside the
    block run on ``n`` threads (at most numba's ``NUMBA_NUM_THREADS``; set only where it
    changes, 2 µs a set, and put back after), BLAS held to one thread (:func:`hold_blas`:
    a compiled loop calls ``sgemm`` from each of its threads)."""
    import numba

    n, before = max(1, min(n, numba.config.NUMBA_NUM_THREADS)), numba.get_num_threads()
    if n != before:
        numba.set_num_threads(n)
    hold_blas()
    try:
        yield n
    finally:
        release_blas()
        if n != before:
            numba.set_num_threads(before)


_TBB_LIBRARIES = ("libtbb.so.12", "libtbb.12.dylib", "tbb12.dll")   # what numba's TBB layer links against
_tbb: list = []


def prefer_tbb() -> str | None:
    """Load the ``tbb`` wheel's library (the fast extra's, on Linux x86-64) before numba starts its
    threads, once a process; its path, or None where the wheel is absent, ``NUMBA_THREADING_LAYER``
    names a layer, or numba's threads already run.

    Why: numba's GNU OpenMP layer terminates a forked child at its first parallel loop ("fork()
    called from a process already using GNU OpenMP, this is unsafe"), so a ``multiprocessing``
    worker or a pre-forking server's worker forked after a qkv kernel had run was killed at its
    first qkv call. numba's TBB layer survives fork, and numba takes it before OpenMP's where it
    can load TBB, but it looks for the library on the system's search path only, where pip's
    wheel (in ``sys.prefix/lib``) is not; loaded here first, it is found. Results have the same
    bits on either layer (qkv's parallel loops fix their pieces themselves); speed measured the
    same (docs/speed.md, "A process that forks")."""
    with _lock:
        if _tbb:
            return _tbb[0]
        _tbb.append(_load_tbb())
        return _tbb[0]


def _load_tbb() -> str | None:
    import importlib.metadata
    import sys

    if os.environ.get("NUMBA_THREADING_LAYER", "default") != "default":
        return None
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and getattr(parallel, "_is_initialized", False):
        return None
    try:
        files = importlib.metadata.distribution("tbb").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    import ctypes
    for f in files:
        if f.name in _TBB_LIBRARIES:
            path = str(f.locate())
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return path
    return None


def blas_holders() -> int:
    """How many holds are active now (0 when nothing of qkv's runs)."""
    return _blas["users"]
