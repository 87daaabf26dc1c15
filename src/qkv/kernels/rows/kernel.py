"""Sequences of up to 1024 keys with the fast extra: a call's every head in one compiled loop.

At the shapes people train and serve (nanoGPT's CPU recipe: B=12, H=4, T=64, D=32; GPT-2 at
T=1024) a head's scores fit a core's cache, and what NumPy spends is its passes over them:
scale, mask, max, subtract, exp, sum, divide, each a temporary. Here each head runs its
products through BLAS and everything between them as one compiled pass a query row
(:mod:`qkv.kernels.rows.compiled`): scores to log2 units (softcapped where asked), ``2^x``
and its sum, the division, the dropout mask; the backward recomputes each row's
probabilities from its own scores. Rows that a causal or windowed mask keeps from most keys
go in blocks of :data:`BLOCK_ROWS` (32 up to :data:`SHORT_ROWS` query rows) that take only
the keys they may see (a causal T of 64 and up: a quarter to half of the products skipped).

The heads of a call are one parallel loop of :mod:`qkv.kernels.rows.fused` (numba's
``prange``; BLAS's ``sgemm`` called from inside it, held to one thread), with no Python
between a head's products and passes and no Python thread hand-off: at nanoGPT's CPU recipe
the forward went from 376 to 175 µs on two threads (AVX-512). Heads handed in as strided
views (a layer's q, k, v cut out of one ``(B, T, 3, H, D)`` projection, Hugging Face's
``(B, T, H, D)`` transposed) go to BLAS in place, each head's row stride its leading
dimension (:func:`_heads4`). The work-unit machinery below (:func:`_run`, :class:`_Heads`)
drives :mod:`.numpy_rows`, the same kernel without the fast extra.

It takes what :func:`applies` says: float32, no weights, a mask that is the same for every
head and gives each row one contiguous run of keys (causal, window, chunk, any alignment;
not a user mask, bias, ALiBi or lengths), softcap and dropout (:mod:`qkv.score_ops`).
``method="auto"`` chooses it where the fast extra is present (:func:`qkv.api.choose_kernel`).

Bits: every head is computed alone, in an order fixed by the problem, so the thread count
never changes a bit, and neither does what ran before: no sum's order depends on where the
heap put a buffer (:func:`.compiled._sum`). They are not :mod:`..reference`'s bits
(another exponential, another order of sums): the kernel is tested against it within
float32's error budget.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading

import numpy as np

from ... import jit, score_ops, threads
from ...masks import MaskSpec
from .. import workspace

MAX_KEYS = 1024          # longer rows go to the tiled kernel (measured: rows at T = 4096 lose in the backward)
UNIT_ENTRIES = 1 << 17   # score entries of one work unit (512 KiB float32; with dP, a 1 MiB L2). Measured,
# 2 threads, AVX-512, ms fwd / fwd+bwd at 2^16 -> 2^17: (1,8,256,16) 0.305 / 0.861 -> 0.260 / 0.764,
# (16,12,192,64) 7.43 / 24.8 -> 6.77 / 22.8, (8,12,1024,64) causal 58.8 / 205 -> 54.2 / 189 (2^18 within
# noise of 2^17: fewer units, fewer GIL hand-offs between the two threads' NumPy calls)
SERIAL_WORK = 1 << 17    # score entries below which a call stays on the calling thread (see _run)
BLOCK_ROWS = 64          # query rows a block where a mask lets blocks skip keys (32 up to SHORT_ROWS rows)
SHORT_ROWS = 128
BLAS_ALONE = 1 << 16     # multiply-adds of one product up to which BLAS is left as it is (OpenBLAS splits from 2^18)
COPY_T_KEYS = 128        # keys up to which the products run against a transposed copy of K (and V): _keys_t


def applies(spec: MaskSpec, dtype) -> bool:
    """True when the compiled pass can run this problem (see the module docstring)."""
    return stackable(spec, dtype) and _fused() is not None


def stackable(spec: MaskSpec, dtype) -> bool:
    """Float32, at most :data:`MAX_KEYS` keys, and a mask that gives each row one run of keys,
    the same for every head (no user mask, bias, ALiBi, lengths or per-item offset)."""
    return (np.dtype(dtype) == np.float32 and spec.tk <= MAX_KEYS and spec.mask is None and spec.bias is None
            and spec.alibi is None and spec.kv_lengths is None and spec.q_lengths is None
            and not isinstance(spec.offset, np.ndarray))


class _Mods:
    """The softcap and dropout arguments of the compiled passes, for a stack of ``n`` heads."""

    def __init__(self, spec: MaskSpec, n: int):
        self.cap = float(spec.softcap or 0.0)
        self.drop = spec.dropout_p > 0
        if self.drop:  # the rows' dropout keys (qkv.score_ops), split into their two 32-bit halves
            k64 = score_ops.keys(spec, 0, spec.tq).reshape(n, spec.tq)
            self.klo = (k64 & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            self.khi = (k64 >> np.uint64(32)).astype(np.uint32)
        else:
            self.klo = self.khi = np.zeros((1, 1), np.uint32)
        self.thresh = np.uint32(score_ops.threshold(spec.dropout_p))
        self.zscale = np.float32(1.0 / (1.0 - spec.dropout_p))
        self.k_start = spec.k_start
        self.case = (self.cap > 0, bool(self.drop))   # which compiled kernel: each case its own (rows_fused.CASES)


def key_runs(spec: MaskSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` int64 ``(Tq,)``: row i may see keys ``lo[i] <= j < hi[i]`` (``lo == hi``:
    none): each row's :meth:`~qkv.masks.MaskSpec.segments` (band, chunk, one alignment).
    Read-only arrays, kept for the next call of the same rules (a training loop's every call)."""
    return _key_runs(spec.tq, spec.tk, *spec.band, spec.chunk, spec.shift(None), spec.k_start)


@functools.lru_cache(maxsize=64)
def _key_runs(tq: int, tk: int, left, right, chunk, shift: int, k_start: int):
    # the rules alone, as a spec whose shift() is `shift` (no arrays: hashable arguments to cache on)
    rules = MaskSpec((), tq, tk, left=left, right=right, chunk=chunk, offset=shift + k_start, k_start=k_start)
    lo, hi = np.zeros(tq, np.int64), np.zeros(tq, np.int64)
    for i in range(tq):
        runs = rules.segments(i, i + 1, 0, tk)
        if runs:
            lo[i], hi[i] = runs[0][0], runs[-1][1]
    lo.flags.writeable = hi.flags.writeable = False
    return lo, hi


def _units(n: int, entries: int, group: int, n_threads: int, unit: int) -> list[list[tuple[int, int]]]:
    """One list a thread: its contiguous share of the kv groups (balanced), cut into units
    whose largest block of scores (``entries`` a head) holds at most ``unit`` entries
    (one group at least), run in turn. Every head is computed alone, so neither the shares
    nor the units change a bit."""
    groups = n // group
    per = max(1, unit // max(entries, 1) // group)
    shares = [(groups * t // n_threads, groups * (t + 1) // n_threads) for t in range(n_threads)]
    return [[(a * group, min(a + per, b) * group) for a in range(a0, b, per)] for a0, b in shares if b > a0]


def _run(job, n: int, tq: int, tk: int, group: int, num_threads: int | None, blocks: tuple,
         inner: int = 1, depth: int = 1, unit: int | None = None) -> None:
    """``job(a, b)`` for every unit: on the calling thread below :data:`SERIAL_WORK` score
    entries, else one share a kernel thread, the calling thread taking the first (one hand-off
    a thread: a pool task costs ~20 µs), with BLAS held to one thread. On the calling thread
    BLAS is held too where a head's product (a block's entries times ``depth``, the head
    width) is past :data:`BLAS_ALONE`: OpenBLAS may split it over its threads, and its Haswell
    kernels' split changes the rounding, so one thread and two would give other bits.
    A unit that straddles items of ``inner`` heads is run in pieces (:func:`_pieces`); a unit
    holds up to ``unit`` score entries (:data:`UNIT_ENTRIES` by default).

    The threshold is a bare call's: at nanoGPT's CPU recipe (12·4 heads of 64², 196,608
    entries) two threads against the calling thread, fwd / fwd+bwd ms, AVX2 0.30 / 0.95
    against 0.39 / 1.37, AVX-512 0.25 / 0.69 against 0.25 / 0.86; without the fast extra
    (:mod:`.numpy_rows`) AVX2 0.39 / 1.09 against 0.46 / 1.49, AVX-512 0.30 / 0.82 against
    0.29 / 0.91. Inside a training step
    the same call came right after OpenBLAS's own threads had run the projections, and the
    hand-off cost more than it saved (the step 40.8 ms threaded, 38.7 on the calling
    thread): :mod:`qkv.nn`'s attention layers hold their calls under 2^18 entries to the
    calling thread (:data:`qkv.nn.attention_layer.LAYER_SERIAL_WORK`)."""
    nt = 1 if n * tq * tk < SERIAL_WORK else (num_threads or threads.get_num_threads())
    entries = max((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in blocks)
    shares = _units(n, entries, group, min(nt, n // group), unit or UNIT_ENTRIES)

    def run(units):
        try:
            for a, b in units:
                for a2, b2 in _pieces(a, b, inner):
                    job(a2, b2)
        finally:
            workspace.release()

    if len(shares) <= 1 and entries * depth <= BLAS_ALONE:
        for units in shares:
            run(units)
        return
    threads.hold_blas()
    try:
        rest = [threads.pool(nt).submit(run, units) for units in shares[1:]]
        run(shares[0])
        for fut in rest:
            fut.result()
    finally:
        threads.release_blas()


def _pieces(a: int, b: int, inner: int) -> list[tuple[int, int]]:
    """Heads ``[a, b)`` cut where they straddle an item of ``inner`` heads: a partial item,
    the whole items, a partial item (each a view of a ``(N/inner, inner, T, D)`` array)."""
    if inner == 1 or (a // inner == (b - 1) // inner) or (a % inner == 0 and b % inner == 0):
        return [(a, b)]
    c0, c1 = -(-a // inner) * inner, b // inner * inner
    return [(x, y) for x, y in ((a, c0), (c0, c1), (c1, b)) if y > x]


class _Heads:
    """``x (*L, T, D)`` read a range of heads at a time, without a copy where its strides
    allow: as ``(N, T, D)``, else as ``(N/inner, inner, T, D)`` (the heads of one item, say
    q's ``(B, H, T, D)`` view of a ``(B, T, 3, H, D)`` projection), else copied. A range is
    given by :meth:`take` as ``(n, T, D)`` within one item, else ``(n/inner, inner, T, D)``
    (whole items: :func:`_pieces`), the same batch axes for every array of the problem.
    ``group > 1`` (kv heads shared by query heads): each range gathered to its query heads,
    ``(b-a, T, D)``, in one copy (from ``x`` as it is where it is no ``(N/G, T, D)`` view:
    Hugging Face's v, a ``(B, Hkv, T, D)`` view of ``(B, T, Hkv, D)``)."""

    def __init__(self, x: np.ndarray, inner: int, group: int = 1):
        self.inner, self.group, self.lead = inner, group, x.shape[:-2]
        y = _view(x, (-1,) + x.shape[-2:])
        if y is None and inner > 1 and group == 1:
            y = _view(x, (-1, inner) + x.shape[-2:])
        if y is None and group == 1:
            y = x.reshape((-1,) + x.shape[-2:])
        self.x = x if y is None else y
        self.shape = (math.prod(x.shape[:-2]),) + x.shape[-2:]

    def take(self, a: int, b: int) -> np.ndarray:
        x, inner, g = self.x, self.inner, self.group
        if g > 1:
            kv = np.arange(a, b) // g                          # each query head's kv head
            x = x[kv] if x.ndim == 3 else x[np.unravel_index(kv, self.lead)]  # (b-a, T, D)
            a, b = 0, b - a
        whole = inner > 1 and a // inner != (b - 1) // inner      # whole items (see _pieces)
        if x.ndim == 3:
            return x[a:b].reshape((-1, inner) + x.shape[1:]) if whole else x[a:b]
        return x[a // inner:b // inner] if whole else x[a // inner, a % inner:a % inner + b - a]


def _view(x: np.ndarray, shape: tuple) -> np.ndarray | None:
    """``x (*L, T, D)`` reshaped to ``shape`` (``(-1, T, D)``, or ``(-1, L[-1], T, D)``) as a
    view, or None where that needs a copy: decided from the strides (an exception to find
    out costs ~5 µs a call, ten times that in a model where torch's work just left the cache)."""
    lead, keep = x.shape[:-2], len(shape) - 3                   # leading axes kept: 0 or 1
    if keep and (not lead or lead[-1] != shape[1]):
        return None
    if x.flags.c_contiguous:                                    # the common case, at 0.1 µs
        return x.reshape(shape)
    merged = lead[:len(lead) - keep]
    dims = [(n, st) for n, st in zip(merged, x.strides[:len(merged)]) if n != 1]
    if all(s0 == s1 * n1 for (_, s0), (n1, s1) in zip(dims, dims[1:])):
        return x.reshape(shape)
    return None


def _flat(x: np.ndarray) -> np.ndarray:
    """A product's ``(n, R, K)`` or ``(n/inner, inner, R, K)`` result as ``(n, R, K)`` (a view)."""
    return x if x.ndim == 3 else x.reshape((x.shape[0] * x.shape[1],) + x.shape[-2:])


def _like(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x (n, R, K)`` with the batch axes of ``y`` (a view)."""
    return x if y.ndim == 3 else x.reshape(y.shape[:-2] + x.shape[-2:])


def _keys_t(x: np.ndarray, tk: int, name: str = "kt") -> np.ndarray:
    """``x (..., Tk, D)`` as the right operand of ``q Kᵀ`` (or ``dO Vᵀ``): up to
    :data:`COPY_T_KEYS` keys a contiguous copy of its transpose ``(..., D, Tk)``, made by the
    unit that uses it (in its thread's buffer ``name``); beyond, the transposed view. OpenBLAS multiplies by a transposed view
    at 0.6x the rate of a plain matrix at training's small heads (48 heads of 64 x 32: 200
    against 117 µs, one thread, AVX-512; 8 of 128 x 64: 203 against 178) and the copy costs
    a sixth to a half of the difference; from 256 keys the two rates are within 8 % and the
    copy costs more than it saves."""
    return workspace.transposed(x, name) if tk <= COPY_T_KEYS else np.swapaxes(x, -1, -2)


def row_blocks(spec: MaskSpec, size: int | None = None) -> tuple:
    """``((r0, r1, k0, k1, lo, hi), ...)``: the query rows cut into blocks that each take
    only the keys ``[k0, k1)`` some row of theirs sees (``lo``/``hi`` relative to ``k0``).
    Blocks of :data:`BLOCK_ROWS` rows (half that up to :data:`SHORT_ROWS` rows) where that
    skips a fifth of the products or more (a causal or windowed T of 64 and up), else one
    block; they depend on the rules alone. Measured (fwd / bwd µs, 2 threads, AVX-512,
    causal): (12,4,64,32) one block 437 / 980, blocks of 32 387 / 922, of 16 370 / 1743;
    (32,8,128,64) 64: 7574 / 25460, 32: 7240 / 23407; (1,8,256,16) 64: 432 / 851, 32:
    502 / 1206 (per-block work outweighs the products skipped). ``size``: blocks of that
    many rows instead."""
    return _row_blocks(spec.tq, spec.tk, size, *spec.band, spec.chunk, spec.shift(None), spec.k_start)


@functools.lru_cache(maxsize=64)
def _row_blocks(tq: int, tk: int, size, *rules):
    lo, hi = _key_runs(tq, tk, *rules)

    def block(r0, r1):
        seen = hi[r0:r1] > lo[r0:r1]
        k0 = int(lo[r0:r1][seen].min()) if seen.any() else 0
        k1 = int(hi[r0:r1][seen].max()) if seen.any() else 0
        bl, bh = np.maximum(lo[r0:r1] - k0, 0), np.maximum(hi[r0:r1] - k0, 0)
        bl.flags.writeable = bh.flags.writeable = False
        return r0, r1, k0, k1, bl, bh

    whole = block(0, tq)
    size = size or (BLOCK_ROWS // 2 if tq <= SHORT_ROWS else BLOCK_ROWS)
    cut = tuple(block(r, min(r + size, tq)) for r in range(0, tq, size))
    products = sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in cut)
    return cut if products <= 0.8 * tq * (whole[3] - whole[2]) else (whole,)


def _inner(spec: MaskSpec, *arrays: np.ndarray) -> int:
    """Heads of one item where some array is read as ``(N/inner, inner, T, D)`` (the last
    leading axis, H of ``(B, H, T, D)``), else 1: where every array is a ``(N, T, D)`` view the
    products stay 3-D (measured: 4-D products cost 10-30 % at (16,12,192,64))."""
    if len(spec.lead) < 2 or all(_view(x, (-1,) + x.shape[-2:]) is not None for x in arrays):
        return 1
    return spec.lead[-1]


def _fused():
    """:mod:`qkv.kernels.rows.fused`, or None (no numba, ``QKV_JIT=0``, or no BLAS ``sgemm`` found for it)."""
    mod = jit.load(jit.ROWS_FUSED)
    return mod if mod is not None and mod.SGEMM else None


def _heads4(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x (*L, T, D)`` as ``(N/inner, inner, T, D)`` and ``inner`` (``L[-1]``), a view where its
    strides allow, for :mod:`.fused`: BLAS reads each head with its row stride as leading
    dimension, so a head's rows need unit column stride and must not overlap (else a copy)."""
    t, d = x.shape[-2:]
    rows_ok = t == 1 or (x.strides[-2] >= 4 * d and x.strides[-2] % 4 == 0)
    if not (x.strides[-1] == 4 and x.flags.aligned and rows_ok):
        x = np.ascontiguousarray(x)
    if x.ndim == 2:
        return x[None, None], 1
    if x.ndim == 3:
        return x[None], x.shape[0]
    return (x if x.ndim == 4 else x.reshape((-1,) + x.shape[-3:])), x.shape[-3]


def _packed_blocks(spec: MaskSpec) -> tuple:
    """:func:`row_blocks` as :mod:`.fused` takes them: ``(r0, r1, k0, k1)`` int64 ``(nb, 4)``
    and every row's ``lo``, ``hi`` relative to its block's ``k0``, int64 ``(Tq,)``; kept per rules."""
    return _packed(spec.tq, spec.tk, *spec.band, spec.chunk, spec.shift(None), spec.k_start)


@functools.lru_cache(maxsize=64)
def _packed(tq: int, tk: int, *rules):
    cut = _row_blocks(tq, tk, None, *rules)
    blocks = np.array([b[:4] for b in cut], np.int64).reshape(-1, 4)
    lo, hi = np.concatenate([b[4] for b in cut]), np.concatenate([b[5] for b in cut])
    return blocks, np.ascontiguousarray(lo, np.int64), np.ascontiguousarray(hi, np.int64)


_ONE_AT_A_TIME = threading.Lock()   # where numba's threading layer takes no concurrent callers


def _call(kernel, n: int, tq: int, tk: int, num_threads: int | None, *args) -> None:
    """``kernel(*args)`` on numba's threads (one below :data:`SERIAL_WORK` score entries), BLAS
    held to one thread (a head's product split over BLAS's threads rounds differently); one
    call at a time where numba's threading layer cannot take more (:data:`.fused.CONCURRENT`)."""
    nt = 1 if n * tq * tk < SERIAL_WORK else (num_threads or threads.get_num_threads(compiled=True))
    with threads.numba_threads(nt), contextlib.nullcontext() if _fused().CONCURRENT else _ONE_AT_A_TIME:
        kernel(*args)


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            num_threads: int | None = None, passes: bool = True):
    """As :func:`reference.forward` (no weights): ``(out (*L,Tq,Dv), lse (*L,Tq), None)``.
    ``passes=False``: the products alone (garbage results; the bench's bound)."""
    (q4, qi), (k4, ki), (v4, _) = _heads4(q), _heads4(k), _heads4(v)
    n, tq, tk = math.prod(spec.lead), spec.tq, spec.tk
    out = np.empty((n, tq, v.shape[-1]), np.float32)
    lse = np.empty((n, tq), np.float32)
    blocks, lo, hi = _packed_blocks(spec)
    m = _Mods(spec, n)
    mod = _fused()
    _call(mod.FORWARD[m.case], n, tq, tk, num_threads, (mod.SGEMM, int(mod.ILP64)), q4, k4, v4, qi, ki, group, out,
          lse, blocks, lo, hi, float(scale), m.cap, m.klo, m.khi, m.k_start, m.thresh, m.zscale, passes)
    return out.reshape(spec.lead + out.shape[-2:]), lse.reshape(spec.lead + (tq,)), None


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None,
             num_threads: int | None = None, passes: bool = True):
    """As :func:`reference.backward`: ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``. ``out``
    and ``lse`` are not read: each row's softmax is recomputed from its own scores."""
    (do4, _), (q4, qi), (k4, ki), (v4, _) = _heads4(dout), _heads4(q), _heads4(k), _heads4(v)
    n, tq, tk = math.prod(spec.lead), spec.tq, spec.tk
    dl = np.zeros((1, 1), np.float32) if dlse is None else np.ascontiguousarray(dlse.reshape(n, tq), np.float32)
    dq = np.empty((n, tq, q.shape[-1]), np.float32)
    nk = n // group
    dk, dv = np.empty((nk, tk, k.shape[-1]), np.float32), np.empty((nk, tk, v.shape[-1]), np.float32)
    blocks, lo, hi = _packed_blocks(spec)
    m = _Mods(spec, n)
    mod = _fused()
    _call(mod.BACKWARD[m.case], n, tq, tk, num_threads, (mod.SGEMM, int(mod.ILP64)), do4, q4, k4, v4, qi, ki, group,
          dq, dk, dv, blocks, lo, hi, float(scale), dl, dlse is not None, m.cap, m.klo, m.khi, m.k_start, m.thresh,
          m.zscale, passes)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
