"""The layers' matrix products and element-wise passes on one pool of threads: numba's.

A training step of :mod:`qkv.nn` alternates products (the projections, the MLP, ``dW`` and
``dx``) with passes between them (the attention kernel, GELU, LayerNorm). NumPy hands a
product to OpenBLAS's own threads, which spin on after it, waiting for the next, for up to
2^28 cycles (a tenth of a second), holding the cores: a pass on qkv's threads right after
finds its second core taken. Measured at nanoGPT's CPU recipe's attention ((12, 4, 64, 32)
causal, 2 threads, Zen 3): 0.7 ms bare, 3.7 ms right after a 2-thread product (the spinner
keeps the core until the scheduler takes it back), 0.4 ms when OpenBLAS's threads sleep at
once (``OPENBLAS_THREAD_TIMEOUT=4``, a setting read only when NumPy loads). So the layers
kept every pass of a step on the calling thread (``LAYER_SERIAL_WORK``,
``fusion.PARALLEL_MIN``), and the second core did only products.

Here the products run where the passes run: :func:`matmul` cuts a float32 product of
:data:`SPLIT_WORK` multiply-adds or more into one piece of rows a kernel thread, each piece
OpenBLAS's ``sgemm`` on one thread, called from numba's threads
(:mod:`qkv.kernels.products_compiled`), as torch runs its products and passes on one OpenMP
pool. OpenBLAS's threads then never start, and numba's threads, spinning a moment between
loops as OpenMP's do, are the ones the next pass wants. The step at nanoGPT's CPU recipe
(2 threads, Zen 3, against torch's in the same process): 1.14x torch's time before, 0.97-1.03x
with the products, the attention and the GELU on numba's threads.

Only inside :func:`one_pool`, which a model enters where every product of its step runs
here (:class:`qkv.models.GPT` of attention blocks). Elsewhere the layers run as before: a
recurrent mixer's kernels call NumPy's products on OpenBLAS's threads, which then spin
against numba's in the next layer, each pool's threads waiting for the other's to give up
the core (measured with the pool on for every layer, the CPU recipe's shape with Mamba-2
mixers: 242 against 72 ms a step; Gated DeltaNet: 273 against 102).

**Bits.** BLAS computes an entry of a product from its row and column alone, but which of its
inner kernels does it depends on where the row falls among the blocks of rows it takes at a
time: OpenBLAS's Haswell ``sgemm`` cut at multiples of 5, 8 or 16 rows gives other last bits
than on the whole (at depths 40 to 768), cut at multiples of 12 the same bits (150 random
shapes, depths 16 to 1500, every transpose case); a piece of one row is its ``gemv``,
rounded otherwise again. So the pieces start at multiples of a grain
found once a process (:func:`grain`: the least of :data:`GRAINS` at which cut products equal
the whole, bit for bit, over probe shapes; 12 on OpenBLAS's Haswell kernels), no piece is
shorter than half a grain, and a product has the bits of NumPy's on one thread, for every
thread count (one kernel thread: the whole product, on the calling thread, BLAS held to one
thread). A BLAS with kernels of its own for small products rounds a piece small enough for
them otherwise than the whole: OpenBLAS's SkylakeX ``sgemm`` (AVX-512) takes a product of up
to 10^6 multiply-adds into its small-matrix kernels, so no grain passes where pieces may be
that small (an Intel Xeon, model 207: a piece of 12 rows of a 520-deep product). There the
probe tries again with no piece under :data:`LEAST_WORKS`' next entry (2^20 multiply-adds: a
product under twice that runs whole), and the grain found with it holds. Where no grain passes, the products
are NumPy's, as before (and the passes stay off numba's threads). Nor is the pool used where
numba is missing or ``QKV_JIT=0``, numba's threading layer is ``workqueue`` (it takes no
concurrent callers), or for a float64 product, one under :data:`SPLIT_WORK`, one with a
single row or column (NumPy's is ``gemv``), ``x @ x.T`` (NumPy's is ``syrk``), an operand
neither C-contiguous nor its transpose, or an ``out`` that overlaps an operand: NumPy's
``matmul`` runs those.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

import numpy as np

from .. import jit, threads

SPLIT_WORK = 1 << 18    # multiply-adds from which a product is cut over the threads (OpenBLAS's own
#                         threading starts there: 65536 · GEMM_MULTITHREAD_THRESHOLD)
PASS_MIN = 1 << 15      # elements from which an element-wise pass (GELU) is cut over the threads
GRAINS = (12, 24, 32, 48, 64, 96, 192)   # row grains tried, least first (:func:`grain`)
LEAST_WORKS = (0, 1 << 20)   # a piece's least multiply-adds, tried in turn with every grain: none,
#                              then past OpenBLAS's small-matrix kernels' 10^6 (module docstring)
_found: dict = {}
_scope = contextvars.ContextVar("qkv_one_pool", default=False)   # one_pool() in force


@contextmanager
def one_pool(on: bool = True):
    """``with one_pool():`` the layers' float32 products, their GELU/SiLU passes and a small
    attention called from this thread (this context) inside the block run on numba's threads
    (module docstring); ``one_pool(False)`` turns it off inside an outer one. A model enters it
    where every product of its step is one of these (:class:`qkv.models.GPT` of attention
    blocks); a kernel that calls NumPy's products on OpenBLAS's threads inside the block (the
    recurrent mixers') would leave them spinning against numba's."""
    token = _scope.set(bool(on))
    try:
        yield
    finally:
        _scope.reset(token)


def _probe(mod, g: int, least: int = 0) -> bool:
    """True where products cut at multiples of ``g`` rows, no piece under ``least``
    multiply-adds, give the whole product's bits: depths 40 and 520, every transpose case,
    three row counts, pieces of 1, 2 and 3 units (``r``: a grain, or the least multiple of one
    that does ``least``'s work) and the ragged end (7, g/2 + 3 and 2 rows where ``least`` is 0:
    one row would be BLAS's gemv; else joined to the piece before it)."""
    rng = np.random.default_rng(0)
    flag = {False: mod.N_, True: mod.T_}
    for k in (40, 520):
        r = g * max(1, -(-least // (45 * k * g)))
        for m in (8 * r + 7, 5 * r + g // 2 + 3, 11 * r + 2):
            cuts = {c for c in (r, 2 * r, 4 * r, 5 * r, m // g * g) if c < m and (not least or m - c >= r)}
            bounds = np.array(sorted(cuts | {0, m}), np.int64)
            for ta, tb in ((False, False), (True, False), (False, True)):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
                b = rng.standard_normal((45, k) if tb else (k, 45)).astype(np.float32)
                whole, cut = np.empty((m, 45), np.float32), np.empty((m, 45), np.float32)
                mod.split_gemm(mod.ADDR, flag[ta], flag[tb], a, b, whole, np.array([0, m], np.int64))
                mod.split_gemm(mod.ADDR, flag[ta], flag[tb], a, b, cut, bounds)
                if not np.array_equal(whole.view(np.uint32), cut.view(np.uint32)):
                    return False
    return True


def grain() -> int:
    """The row grain of this process's BLAS (module docstring), 0 where the pool does not apply
    (no numba or ``QKV_JIT=0``, no ``sgemm``, a ``workqueue`` layer, or no grain passes)."""
    if "grain" not in _found:
        mod = jit.load(jit.PRODUCTS)
        found = (0, 0)
        if mod is not None and mod.SGEMM and mod.CONCURRENT:
            with threads.numba_threads(1):
                found = next(((g, w) for w in LEAST_WORKS for g in GRAINS if _probe(mod, g, w)), found)
        _found["grain"], _found["least"] = found
    return _found["grain"]


def least_work() -> int:
    """The fewest multiply-adds a piece of a cut product may have here (0: any piece of a grain;
    :data:`LEAST_WORKS`, module docstring)."""
    grain()
    return _found.get("least", 0)


def threads_for(units: int, per_unit: int) -> int:
    """How many of numba's threads a job of ``units`` (rows, elements) in pieces of at least
    ``per_unit`` takes here: 1 where the pool does not apply (:func:`grain`), else the kernel
    threads (:func:`qkv.get_num_threads`, at most numba's) up to ``units // per_unit``."""
    nt = threads.get_num_threads(compiled=True)
    if nt <= 1 or units < 2 * per_unit or not pooled():
        return 1
    import numba
    return max(1, min(nt, numba.config.NUMBA_NUM_THREADS, units // per_unit))


def pooled() -> bool:
    """True inside :func:`one_pool` where :func:`matmul` runs float32 products on numba's
    threads, or on the calling thread with BLAS held to one where one kernel thread is asked
    for (so OpenBLAS's threads do not spin between a layer's steps, and a small attention may
    take the kernel threads too)."""
    return _scope.get() and grain() > 0


def _operand(x: np.ndarray):
    """``(array, transposed)``: x itself, or the C-contiguous array it transposes; None."""
    if x.flags.c_contiguous:
        return x, False
    if x.T.flags.c_contiguous:
        return x.T, True
    return None


def _bounds(m: int, parts: int, g: int) -> np.ndarray:
    """``parts`` pieces of ``m`` rows as near equal as multiples of ``g`` allow: their bounds."""
    cuts = {0, m} | {min(m, round(m * i / parts / g) * g) for i in range(1, parts)}
    return np.array(sorted(cuts), np.int64)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ b`` of 2-D arrays (into ``out`` when given): NumPy's ``matmul``, or the same product,
    the same bits, cut over numba's threads (module docstring). Other arrays: NumPy's ``matmul``."""
    if a.ndim != 2 or b.ndim != 2:
        return np.matmul(a, b, out=out)
    m, k = a.shape
    n = b.shape[1]
    ops = None
    if a.dtype == b.dtype == np.float32 and m * n * k >= SPLIT_WORK and k == b.shape[0] and min(m, n) > 1 and \
            not (a.shape == b.shape[::-1] and np.may_share_memory(a, b)) and pooled() and \
            (out is None or (out.dtype == np.float32 and out.shape == (m, n) and out.flags.c_contiguous
                             and not np.may_share_memory(out, a) and not np.may_share_memory(out, b))):
        ops = (_operand(a), _operand(b))
    if ops is None or ops[0] is None or ops[1] is None:
        return np.matmul(a, b, out=out)
    mod = jit.load(jit.PRODUCTS)
    g, least = grain(), least_work()
    rows = g if not least else -(-least // (n * k)) + g   # pieces within a grain of equal: none under least
    bounds = _bounds(m, threads_for(m, rows), g)
    out = np.empty((m, n), np.float32) if out is None else out
    flag = {False: mod.N_, True: mod.T_}
    with threads.numba_threads(len(bounds) - 1):
        mod.split_gemm(mod.ADDR, flag[ops[0][1]], flag[ops[1][1]], ops[0][0], ops[1][0], out, bounds)
    return out
