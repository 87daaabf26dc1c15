"""Sequences of up to 1024 keys with the fast extra: stacked products, one compiled pass a row.

At the shapes people train and serve (nanoGPT's CPU recipe: B=12, H=4, T=64, D=32; GPT-2 at
T=1024) a head's scores fit a core's cache, and what NumPy spends is its passes over them:
scale, mask, max, subtract, exp, sum, divide, each a temporary. Here a work unit of heads
runs the products as stacked ``np.matmul`` calls (BLAS, one matrix per head) and everything
between them as one compiled pass a query row (:mod:`qkv.kernels.rows_compiled`, numba):
scores to log2 units (softcapped where asked), ``2^x`` and its sum, the division, the
dropout mask; the backward recomputes each row's probabilities from its own scores. Rows
that a causal or windowed mask keeps from most keys go in blocks of :data:`BLOCK_ROWS`
that take only the keys they may see (a causal T of 256 and up: a quarter to half of the
products skipped).

It takes what :func:`applies` says: float32, no weights, a mask that is the same for every
head and gives each row one contiguous run of keys (causal, window, chunk, any alignment;
not a user mask, bias, ALiBi or lengths), softcap and dropout (:mod:`qkv.score_ops`).
``method="auto"`` chooses it where the fast extra is present (:func:`qkv.api._kernel`).

Bits: every head is computed alone, in an order fixed by the problem, so the thread count
and the work units never change a bit. They are not :mod:`.reference`'s bits (another
exponential, another order of sums): the kernel is tested against it within float32's
error budget.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import jit, score_ops, threads
from ..masks import MaskSpec
from . import reference

MAX_KEYS = 1024          # longer rows go to the tiled kernel (measured: rows at T = 4096 lose in the backward)
UNIT_ENTRIES = 1 << 16   # score entries of one work unit (256 KiB float32; with dP, 512 KiB of a 1 MiB L2)
SERIAL_WORK = 1 << 18    # score entries below which a call stays on the calling thread (see _run)
BLOCK_ROWS = 64          # query rows a block where a mask lets blocks skip keys


def applies(spec: MaskSpec, dtype) -> bool:
    """True when the compiled pass can run this problem (see the module docstring)."""
    return (np.dtype(dtype) == np.float32 and spec.tk <= MAX_KEYS and spec.mask is None and spec.bias is None
            and spec.alibi is None and spec.kv_lengths is None and spec.q_lengths is None
            and not isinstance(spec.offset, np.ndarray) and jit.load(jit.ROWS) is not None)


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

    def args(self, a: int, b: int, r0: int, r1: int, k0: int) -> tuple:
        """``(cap, klo, khi, col0, thresh, zscale, drop)`` for heads a:b, rows r0:r1, keys from k0."""
        klo, khi = (self.klo, self.khi) if not self.drop else (self.klo[a:b, r0:r1], self.khi[a:b, r0:r1])
        return self.cap, klo, khi, self.k_start + k0, self.thresh, self.zscale, self.drop


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


def _units(n: int, entries: int, group: int, n_threads: int) -> list[list[tuple[int, int]]]:
    """One list a thread: its contiguous share of the kv groups (balanced), cut into units
    whose largest block of scores (``entries`` a head) holds at most :data:`UNIT_ENTRIES`
    (one group at least), run in turn. Every head is computed alone, so neither the shares
    nor the units change a bit."""
    groups = n // group
    per = max(1, UNIT_ENTRIES // max(entries, 1) // group)
    shares = [(groups * t // n_threads, groups * (t + 1) // n_threads) for t in range(n_threads)]
    return [[(a * group, min(a + per, b) * group) for a in range(a0, b, per)] for a0, b in shares if b > a0]


def _run(job, n: int, tq: int, tk: int, group: int, num_threads: int | None, blocks: tuple) -> None:
    """``job(a, b)`` for every unit: on the calling thread below :data:`SERIAL_WORK` score
    entries (BLAS as it is), else one share a kernel thread, the calling thread taking the
    first (one hand-off a thread: a pool task costs ~20 µs), with BLAS held to one thread.

    The threshold was measured inside a training step, not alone: at nanoGPT's CPU recipe
    (12·4 heads of 64², 196,608 entries) the two threads' hand-off and BLAS's hold came after
    OpenBLAS's own threads had just run the projections, and cost more than they saved (the
    step 40.8 ms threaded, 38.7 on the calling thread). Alone such a call is faster threaded
    (backward 0.65 against 1.05 ms), which is what the shapes suite sees at its two smallest
    shapes."""
    nt = 1 if n * tq * tk < SERIAL_WORK else (num_threads or threads.get_num_threads())
    entries = max((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in blocks)
    shares = _units(n, entries, group, min(nt, n // group))

    def run(units):
        for a, b in units:
            job(a, b)

    if len(shares) <= 1:
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


def _stack(x: np.ndarray) -> np.ndarray:
    """``(*L, T, D) -> (N, T, D)`` (a view where the layout allows)."""
    return x.reshape((-1,) + x.shape[-2:])


def row_blocks(spec: MaskSpec) -> tuple:
    """``((r0, r1, k0, k1, lo, hi), ...)``: the query rows cut into blocks that each take
    only the keys ``[k0, k1)`` some row of theirs sees (``lo``/``hi`` relative to ``k0``).
    Blocks of :data:`BLOCK_ROWS` rows where that skips a fifth of the products or more (a
    causal or windowed T of 256 and up), else one block; they depend on the rules alone."""
    return _row_blocks(spec.tq, spec.tk, *spec.band, spec.chunk, spec.shift(None), spec.k_start)


@functools.lru_cache(maxsize=64)
def _row_blocks(tq: int, tk: int, *rules):
    lo, hi = _key_runs(tq, tk, *rules)

    def block(r0, r1):
        seen = hi[r0:r1] > lo[r0:r1]
        k0 = int(lo[r0:r1][seen].min()) if seen.any() else 0
        k1 = int(hi[r0:r1][seen].max()) if seen.any() else 0
        bl, bh = np.maximum(lo[r0:r1] - k0, 0), np.maximum(hi[r0:r1] - k0, 0)
        bl.flags.writeable = bh.flags.writeable = False
        return r0, r1, k0, k1, bl, bh

    whole = block(0, tq)
    cut = tuple(block(r, min(r + BLOCK_ROWS, tq)) for r in range(0, tq, BLOCK_ROWS))
    products = sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in cut)
    return cut if products <= 0.8 * tq * (whole[3] - whole[2]) else (whole,)


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            num_threads: int | None = None):
    """As :func:`reference.forward` (no weights): ``(out (*L,Tq,Dv), lse (*L,Tq), None)``."""
    mod = jit.load(jit.ROWS)
    qf, kf, vf = _stack(q), _stack(k), _stack(v)          # (N,Tq,D), (N/G,Tk,D), (N/G,Tk,Dv)
    n, tq, tk = qf.shape[0], spec.tq, spec.tk
    out = np.empty((n, tq, vf.shape[-1]), np.float32)
    lse = np.empty((n, tq), np.float32)
    blocks = row_blocks(spec)
    mods = _Mods(spec, n)

    def job(a, b):
        kk = reference._expand_groups(kf[a // group:b // group], group)
        vv = reference._expand_groups(vf[a // group:b // group], group)
        for r0, r1, k0, k1, lo, hi in blocks:
            # (n,R,D) @ (n,D,K) -> (n,R,K): the keys [k0, k1) these rows may see
            s = np.matmul(qf[a:b, r0:r1], np.swapaxes(kk[:, k0:k1], -1, -2))
            mod.softmax_rows(s, lo, hi, scale, lse[a:b, r0:r1], *mods.args(a, b, r0, r1, k0))  # s -> P
            np.matmul(s, vv[:, k0:k1], out=out[a:b, r0:r1])        # (n,R,K) @ (n,K,Dv) -> (n,R,Dv)

    _run(job, n, tq, tk, group, num_threads, blocks)
    return out.reshape(spec.lead + out.shape[-2:]), lse.reshape(spec.lead + (tq,)), None


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None,
             num_threads: int | None = None):
    """As :func:`reference.backward`: ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``. ``out``
    and ``lse`` are not read: each row's softmax is recomputed from its own scores."""
    mod = jit.load(jit.ROWS)
    qf, kf, vf, dof = _stack(q), _stack(k), _stack(v), _stack(dout)
    n, tq, tk = qf.shape[0], spec.tq, spec.tk
    dl = np.zeros((1, 1), np.float32) if dlse is None else np.ascontiguousarray(dlse.reshape(n, tq))
    dq, dk, dv = np.empty(qf.shape, np.float32), np.empty(kf.shape, np.float32), np.empty(vf.shape, np.float32)
    blocks = row_blocks(spec)
    mods = _Mods(spec, n)

    def job(a, b):
        ka, kb = a // group, b // group
        kk, vv = reference._expand_groups(kf[ka:kb], group), reference._expand_groups(vf[ka:kb], group)
        if len(blocks) == 1 and blocks[0][2:4] == (0, tk):
            gk = gv = None                                 # one block over every key: its products are dK, dV
        else:
            gk, gv = np.zeros((b - a,) + kf.shape[1:], np.float32), np.zeros((b - a,) + vf.shape[1:], np.float32)
        for r0, r1, k0, k1, lo, hi in blocks:
            qb, dob, kb_, vb = qf[a:b, r0:r1], dof[a:b, r0:r1], kk[:, k0:k1], vv[:, k0:k1]
            p = np.matmul(qb, np.swapaxes(kb_, -1, -2))    # raw products (n,R,K)
            ds = np.matmul(dob, np.swapaxes(vb, -1, -2))   # dP = dO Vᵀ (n,R,K)
            mod.softmax_grad_rows(p, ds, lo, hi, scale, dl if dlse is None else dl[a:b, r0:r1], dlse is not None,
                                  *mods.args(a, b, r0, r1, k0))  # p -> P ∘ Z, ds -> dS
            np.matmul(ds, kb_, out=dq[a:b, r0:r1])         # (n,R,K) @ (n,K,D) -> (n,R,D)
            pk = np.matmul(np.swapaxes(ds, -1, -2), qb)    # (n,K,R) @ (n,R,D) -> (n,K,D)
            pv = np.matmul(np.swapaxes(p, -1, -2), dob)    # (n,K,R) @ (n,R,Dv) -> (n,K,Dv)
            if gk is None:
                gk, gv = pk, pv
            else:
                gk[:, k0:k1] += pk
                gv[:, k0:k1] += pv
        if group > 1:                                      # the G query heads of each kv head add up
            gk = gk.reshape((-1, group) + gk.shape[-2:]).sum(axis=1)
            gv = gv.reshape((-1, group) + gv.shape[-2:]).sum(axis=1)
        dk[ka:kb], dv[ka:kb] = gk, gv

    _run(job, n, tq, tk, group, num_threads, blocks)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
