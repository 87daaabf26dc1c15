"""BLAS's ``sgemm`` called from compiled code (numba), NumPy's own where it can be found.

Load it through a compiled module that imports it (:mod:`qkv.kernels.rows.fused`,
:mod:`qkv.recurrent.decay.compiled`). :func:`gemm` is a row-major product on 2-D views read in
place (each operand's leading dimension is its row stride), with no Python between calls: the
kernels that call it run a whole loop of small products and the passes between them in one
compiled function. NumPy's ``matmul`` calls the same ``sgemm`` for a blasable matrix, so a
product made here rounds as NumPy's does (the callers test it).

Row-major products as column-major BLAS: ``C = op(A) op(B)`` (``m × n``, row-major) is the
column-major ``Cᵀ = op(B)ᵀ op(A)ᵀ``, i.e. ``sgemm(tb, ta, n, m, k, B, ldb, A, lda, C, ldc)``.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

f32 = np.float32


def _find_sgemm() -> tuple[int, bool]:
    """``(address, ilp64)`` of a Fortran ``sgemm``: NumPy's own BLAS where its build exports one
    with 64-bit integers (NumPy's wheels: ``scipy_sgemm_64_``), else SciPy's ``cython_blas``
    (32-bit integers; the one numba's ``np.dot`` calls); ``(0, False)`` where neither is found.
    NumPy's OpenBLAS 0.3.31 ran training's small products 5-20 % faster than SciPy's 0.3.30 as
    Haswell (48 heads of 64 x 32 x 64: 152 against 183 µs, one thread), level with AVX-512."""
    import ctypes
    import os

    from ..threads import blas_libraries
    for path in blas_libraries():
        try:
            dll = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        for name in ("scipy_sgemm_64_", "sgemm_64_", "sgemm64_"):
            if hasattr(dll, name):
                return ctypes.cast(getattr(dll, name), ctypes.c_void_p).value, True
    try:
        from numba.extending import get_cython_function_address
        return get_cython_function_address("scipy.linalg.cython_blas", "sgemm"), False
    except ImportError:
        return 0, False


SGEMM, ILP64 = _find_sgemm()


N_, T_ = 78, 84  # 'N' and 'T': BLAS's transpose flags


def threading_layer() -> str:
    """numba's threading layer, started now: ``"omp"`` or ``"tbb"`` take concurrent callers
    from several Python threads; ``"workqueue"`` (neither OpenMP nor TBB found) aborts the
    process on them, so :mod:`qkv.kernels.rows.kernel` then runs one call at a time and
    :mod:`qkv.nn.products` leaves its products to NumPy (each module's ``CONCURRENT``)."""
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()
    return numba.threading_layer()


def _sgemm_call(bits: int):
    """An intrinsic calling the Fortran ``sgemm`` at address ``addr`` with ``bits``-bit integers,
    every scalar passed by pointer (its ABI); ``a``, ``b``, ``c`` arrays whose first element is
    the matrix's."""
    @intrinsic
    def call(typingctx, addr, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        return types.void(addr, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), codegen

    def codegen(context, builder, sig, args):
        i8, ii, fl = ir.IntType(8), ir.IntType(bits), ir.FloatType()
        ity = types.int64 if bits == 64 else types.int32
        ptrs = []
        kinds = ("c", "c", "i", "i", "i", "f", "a", "i", "a", "i", "f", "a", "i")   # char, int, float, array
        for val, ty, arg in zip(args[1:], sig.args[1:], kinds):
            if arg == "a":
                ptrs.append(builder.bitcast(context.make_array(ty)(context, builder, val).data, fl.as_pointer()))
                continue
            llty, nbty = {"c": (i8, types.int8), "i": (ii, ity), "f": (fl, types.float32)}[arg]
            slot = cgutils.alloca_once(builder, llty)
            builder.store(context.cast(builder, val, ty, nbty), slot)
            ptrs.append(slot)
        fnty = ir.FunctionType(ir.VoidType(), [p.type for p in ptrs])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), ptrs)
        return context.get_dummy_value()
    return call


_sgemm32, _sgemm64 = _sgemm_call(32), _sgemm_call(64)


@numba.njit(inline="always")
def _ld(x):
    """The leading dimension of a row-major 2-D float32 view (its row stride in elements)."""
    return max(x.strides[0] // 4, x.shape[1], 1)


@numba.njit(inline="always")
def gemm(addr, ta, tb, m, n, k, a, b, beta, c):
    """Row-major ``c (m, n) = op(a) op(b) (+ c where beta = 1)``; ``op(a)`` is ``m × k``. ``addr``
    ``(address, ilp64)``: the sgemm and its integer width (:func:`_find_sgemm`)."""
    if addr[1]:
        _sgemm64(addr[0], tb, ta, n, m, k, f32(1.0), b, _ld(b), a, _ld(a), f32(beta), c, _ld(c))
    else:
        _sgemm32(addr[0], tb, ta, n, m, k, f32(1.0), b, _ld(b), a, _ld(a), f32(beta), c, _ld(c))


@numba.njit(inline="always")
def transpose(x, out, c0):
    """``out[:, c0:c0 + m] = xᵀ`` (``x (m, n)``, ``out (n, ·)``), written row by row: an operand laid
    out so that no product reads one along its rows (``A Bᵀ``), which OpenBLAS's SkylakeX (AVX-512)
    small-matrix kernels ran at half the speed of ``A B`` or ``Aᵀ B`` at a chunk's or a short head's sizes."""
    for j in range(x.shape[1]):
        for i in range(x.shape[0]):
            out[j, c0 + i] = x[i, j]


@numba.njit(inline="always")
def rows_times(x, e, out):
    """``out = diag(e) x`` (``x (C, D)``, ``e (C,)``)."""
    for i in range(x.shape[0]):
        f = e[i]
        for d in range(x.shape[1]):
            out[i, d] = f * x[i, d]
