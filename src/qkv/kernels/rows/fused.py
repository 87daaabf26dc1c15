"""The row kernel's whole call compiled (numba): one parallel loop over heads, BLAS inside.

Load it through ``qkv.jit.load(qkv.jit.ROWS_FUSED)`` only. :mod:`qkv.kernels.rows.kernel` hands
:func:`forward` and :func:`backward` every head of a call at once; each head runs its blocks
of rows in turn, ``S = Q Kᵀ`` (BLAS ``sgemm``), the row pass of :mod:`.compiled` (``S``
to ``P``, or ``P`` and ``dP`` to ``dS``), then ``P V`` (or ``dS K``, ``dSᵀ Q``, ``Pᵀ dO``), with
no Python between them.

Why: at training's and serving's short sequences a call is a fraction of a millisecond, and
the same work driven from Python threads spent it on hand-offs. Measured at B=12 H=4 T=64
D=32 (forward, float32, 2 threads, AVX-512): the units on two Python threads 376 µs (the
hand-off to a pool thread and back, and the GIL between the unit's NumPy calls, cost what
the second thread saved: 268 µs on one thread against 263), one compiled loop over heads
175 µs. numba's ``prange`` runs on its threading layer's workers (OpenMP's or TBB's), which
wait for the next loop spinning a moment before they sleep, as torch's do.

The products are BLAS's ``sgemm``, called through its address (:func:`_find_sgemm`: NumPy's
own OpenBLAS, else SciPy's ``cython_blas``) with the leading dimension of each operand, so a
head cut out of a wider array (Hugging Face's ``(B, T, H, D)`` seen as ``(B, H, T, D)``, a
layer's ``(B, T, 3, H, D)`` projection) is read in place; the caller holds BLAS to one
thread (a product split over threads rounds otherwise). Every head is computed alone in an
order fixed by the problem, so the thread count never changes a bit.

Row-major products as column-major BLAS: ``C = op(A) op(B)`` (``m × n``, row-major) is the
column-major ``Cᵀ = op(B)ᵀ op(A)ᵀ``, i.e. ``sgemm(tb, ta, n, m, k, B, ldb, A, lda, C, ldc)``.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import types

from ..blas_compiled import ILP64, N_, SGEMM, T_, gemm, threading_layer, transpose
from ..flash.compiled import FASTMATH, wide_vectors
from .compiled import LOG2E, NEG_INF, _zero, backward_pass, forward_pass

LAYER = threading_layer()
CONCURRENT = LAYER in ("omp", "tbb")   # concurrent callers allowed (else :mod:`.kernel` runs one at a time)
f32 = np.float32
_IN = types.Array(types.float32, 4, "A", readonly=True)   # (N/inner, inner, T, D), any strides, read only:
# one compiled signature for every layout (a writable or C-contiguous array converts to it)
_I, _B, _F32, _U32 = types.int64, types.boolean, types.float32, types.uint32
_C2, _C3 = types.float32[:, ::1], types.float32[:, :, ::1]
_BLOCKS, _RUNS, _KEYS = types.int64[:, ::1], types.int64[::1], types.uint32[:, ::1]
FWD_SIG = types.void(types.UniTuple(_I, 2), _IN, _IN, _IN, _I, _I, _I, _C3, _C2, _BLOCKS, _RUNS, _RUNS,
                     types.float64, types.float64, _KEYS, _KEYS, _I, _U32, _F32, _B)
BWD_SIG = types.void(types.UniTuple(_I, 2), _IN, _IN, _IN, _IN, _I, _I, _I, _C3, _C3, _C3, _BLOCKS, _RUNS, _RUNS,
                     types.float64, _C2, _B, types.float64, _KEYS, _KEYS, _I, _U32, _F32, _B)


def compiled_at_first_call(sig, **options):
    """``numba.njit(sig, **options)`` made at the decorated function's first call, not at import:
    compiled (or loaded from the cache) for ``sig`` alone then. The row kernel's forward and
    backward of one case (:data:`FORWARD`, :data:`BACKWARD`) cost seconds of CPU to compile
    (docs/speed.md), so a job pays only for the cases and directions it runs (inference and
    ``qkv sample`` never for a backward)."""
    def wrap(fn):
        made: list = []
        lock = threading.Lock()

        def call(*args):
            if not made:
                with lock:
                    if not made:
                        made.append(numba.njit(sig, **options)(fn))
            return made[0](*args)
        call.__doc__, call.__name__, call.__wrapped__ = fn.__doc__, fn.__name__, fn
        return call
    return wrap


COPY_T_KEYS = 128  # keys up to which q Kᵀ and dO Vᵀ run against a transposed copy (as qkv.kernels.rows.kernel.COPY_T_KEYS)


@numba.njit(inline="always")
def _key_side(addr, a, kh, kt, r0, r1, k0, k1, s):
    """``s = a[r0:r1] kh[k0:k1]ᵀ``: against ``kt = khᵀ`` where one was made (short rows: see
    :data:`qkv.kernels.rows.kernel.COPY_T_KEYS`), else against ``kh`` transposed by BLAS."""
    if kt.shape[1] == kh.shape[0]:
        gemm(addr, N_, N_, r1 - r0, k1 - k0, a.shape[1], a[r0:r1], kt[:, k0:k1], 0, s)
    else:
        gemm(addr, N_, T_, r1 - r0, k1 - k0, a.shape[1], a[r0:r1], kh[k0:k1], 0, s)


@numba.njit(inline="always")
def _head(x4, h, inner):
    """Head ``h`` of ``x4 (N/inner, inner, T, D)``: a ``(T, D)`` view."""
    return x4[h // inner, h % inner]


@numba.njit(inline="always")
def _width(blocks):
    """The most score entries of one block: its scratch size."""
    width = 1
    for b in range(blocks.shape[0]):
        width = max(width, (blocks[b, 1] - blocks[b, 0]) * (blocks[b, 3] - blocks[b, 2]))
    return width


@numba.njit(inline="always")
def _maybe_t(x, copy_t):
    """``xᵀ`` as a contiguous copy where ``copy_t``, else an empty ``(1, 0)`` array (BLAS transposes)."""
    if copy_t:
        t = np.empty((x.shape[1], x.shape[0]), f32)
        transpose(x, t, 0)
        return t
    return np.empty((1, 0), f32)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _forward_head(addr, h, q4, k4, v4, qi, ki, group, out, lse, blocks, lo, hi, scale, cap, klo, khi, k_start,
                  thresh, zscale, capped, drop, passes):
    """Head ``h``'s blocks of rows in turn: ``S = Q Kᵀ``, the row pass (``S`` to ``P``), ``P V``.
    ``capped`` and ``drop`` are literal constants (one compile per case: :func:`forward`)."""
    wide_vectors()
    c, sc = f32(scale * LOG2E), f32(scale)
    cap_in = f32(scale / cap) if capped else f32(0.0)
    cap_out = f32(cap)
    qh, g = _head(q4, h, qi), h // group
    kh, vh = _head(k4, g, ki), _head(v4, g, ki)
    kt = _maybe_t(kh, kh.shape[0] <= COPY_T_KEYS)
    buf = np.empty(_width(blocks), f32)
    o = out[h]
    for b in range(blocks.shape[0]):
        r0, r1, k0, k1 = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3]
        if k1 <= k0:                                       # rows that see no key: 0, lse -inf
            for i in range(r0, r1):
                _zero(o[i])
                lse[h, i] = NEG_INF
            continue
        s = buf[:(r1 - r0) * (k1 - k0)].reshape((1, r1 - r0, k1 - k0))
        _key_side(addr, qh, kh, kt, r0, r1, k0, k1, s[0])                     # Q Kᵀ (R,K)
        if passes:
            kl, kh_ = (klo[h:h + 1, r0:r1], khi[h:h + 1, r0:r1]) if drop else (klo, khi)
            forward_pass(s, lo[r0:r1], hi[r0:r1], c, sc, cap_in, cap_out, lse[h:h + 1, r0:r1], kl, kh_, k_start + k0,
                         thresh, zscale, capped, drop)                         # S -> P (∘ Z)
        gemm(addr, N_, N_, r1 - r0, o.shape[1], k1 - k0, s[0], vh[k0:k1], 0, o[r0:r1])  # P V (R,Dv)


def _forward_kernel(capped: bool, drop: bool):
    """The forward kernel of one case of softcap (``capped``: ``cap > 0``) and dropout, the
    flags closure constants: compiled at its first call with that case's row pass alone (the
    four cases' loops in one kernel cost four times the CPU to compile; docs/speed.md)."""
    @compiled_at_first_call(FWD_SIG, parallel=True, nogil=True, cache=True)
    def forward(addr, q4, k4, v4, qi, ki, group, out, lse, blocks, lo, hi, scale, cap, klo, khi, k_start,
                thresh, zscale, passes):
        """``out (N, Tq, Dv)``, ``lse (N, Tq)`` of heads ``q4 (N/qi, qi, Tq, D)`` against kv heads
        ``k4, v4 (Nk/ki, ki, Tk, D|Dv)`` (query head h reads kv head ``h // group``). ``blocks``
        int64 ``(nb, 4)``: rows ``r0:r1`` take keys ``k0:k1``; ``lo``/``hi`` ``(Tq,)`` each row's run
        relative to its block's ``k0``. The rest as :func:`.compiled.forward_pass`;
        ``passes=False`` leaves the row pass out (the bench's products-only bound)."""
        for h in numba.prange(out.shape[0]):   # h as int64: typing sees int64, the loop uint64 (two compiles)
            _forward_head(addr, np.int64(h), q4, k4, v4, qi, ki, group, out, lse, blocks, lo, hi, scale, cap, klo,
                          khi, k_start, thresh, zscale, capped, drop, passes)
    return forward


CASES = tuple((capped, drop) for capped in (False, True) for drop in (False, True))
FORWARD = {case: _forward_kernel(*case) for case in CASES}   # (capped, drop) -> its forward kernel


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def _backward_group(addr, g, do4, q4, k4, v4, qi, ki, group, dq, dk, dv, blocks, lo, hi, scale, dlse, use_dlse,
                    cap, klo, khi, k_start, thresh, zscale, capped, drop, passes):
    """The ``group`` query heads of kv head ``g`` in turn: dq of each, dk and dv summed in that
    order. ``capped`` and ``drop`` literal constants, as :func:`_forward_head`'s."""
    wide_vectors()
    c, sc = f32(scale * LOG2E), f32(scale)
    cap_in = f32(scale / cap) if capped else f32(0.0)
    cap_out = f32(cap)
    kh, vh = _head(k4, g, ki), _head(v4, g, ki)
    kt, vt = _maybe_t(kh, kh.shape[0] <= COPY_T_KEYS), _maybe_t(vh, vh.shape[0] <= COPY_T_KEYS)
    width = _width(blocks)
    pbuf, dbuf = np.empty(width, f32), np.empty(width, f32)
    gk, gv = dk[g], dv[g]
    for i in range(gk.shape[0]):
        _zero(gk[i])
        _zero(gv[i])
    for h in range(g * group, (g + 1) * group):
        qh, doh, gq = _head(q4, h, qi), _head(do4, h, qi), dq[h]
        for b in range(blocks.shape[0]):
            r0, r1, k0, k1 = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3]
            if k1 <= k0:                                   # rows that see no key: no gradient
                for i in range(r0, r1):
                    _zero(gq[i])
                continue
            n_r, n_k = r1 - r0, k1 - k0
            p = pbuf[:n_r * n_k].reshape((1, n_r, n_k))
            ds = dbuf[:n_r * n_k].reshape((1, n_r, n_k))
            _key_side(addr, qh, kh, kt, r0, r1, k0, k1, p[0])       # Q Kᵀ
            _key_side(addr, doh, vh, vt, r0, r1, k0, k1, ds[0])     # dP = dO Vᵀ
            if passes:
                kl, kh_ = (klo[h:h + 1, r0:r1], khi[h:h + 1, r0:r1]) if drop else (klo, khi)
                dl = dlse[h:h + 1, r0:r1] if use_dlse else dlse
                backward_pass(p, ds, lo[r0:r1], hi[r0:r1], c, cap_in, cap_out, sc, dl, use_dlse, kl, kh_,
                              k_start + k0, thresh, zscale, capped, drop)      # -> P ∘ Z, dS
            gemm(addr, N_, N_, n_r, gq.shape[1], n_k, ds[0], kh[k0:k1], 0, gq[r0:r1])      # dQ = dS K
            gemm(addr, T_, N_, n_k, gk.shape[1], n_r, ds[0], qh[r0:r1], 1, gk[k0:k1])      # dK += dSᵀ Q
            gemm(addr, T_, N_, n_k, gv.shape[1], n_r, p[0], doh[r0:r1], 1, gv[k0:k1])      # dV += Pᵀ dO


def _backward_kernel(capped: bool, drop: bool):
    """The backward kernel of one case, as :func:`_forward_kernel`."""
    @compiled_at_first_call(BWD_SIG, parallel=True, nogil=True, cache=True)
    def backward(addr, do4, q4, k4, v4, qi, ki, group, dq, dk, dv, blocks, lo, hi, scale, dlse, use_dlse, cap,
                 klo, khi, k_start, thresh, zscale, passes):
        """``dq (N, Tq, D)``, ``dk (Nk, Tk, D)``, ``dv (Nk, Tk, Dv)`` (every kv head's query heads
        summed, in order), arguments as the forward's; ``dlse (N, Tq)`` read where ``use_dlse``."""
        for g in numba.prange(dk.shape[0]):   # g as int64, as in the forward
            _backward_group(addr, np.int64(g), do4, q4, k4, v4, qi, ki, group, dq, dk, dv, blocks, lo, hi, scale,
                            dlse, use_dlse, cap, klo, khi, k_start, thresh, zscale, capped, drop, passes)
    return backward


BACKWARD = {case: _backward_kernel(*case) for case in CASES}   # (capped, drop) -> its backward kernel
