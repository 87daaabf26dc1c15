"""numba passes of the generalized delta rule (dplr: RWKV-7); load it through
``qkv.jit.load(qkv.jit.DPLR)`` only.

:func:`chunk_grads`: the backward's passes (b') and the chunks' own gradients
(:mod:`.backward`'s module docstring) in one sweep a head, float32, the chunks backwards, each
chunk's products while its blocks are in cache, ``sgemm`` called directly
(:func:`qkv.kernels.blas_compiled.gemm`). It reads the chunk's transition through its
structure ``M = diag(eC) + btᵀ W`` instead of the ``(Dk, Dk)`` matrix, with ``u = U + W S_in``::

    Mᵀ dS = eC ∘ dS + Wᵀ (bt dS)             (bt dS: the same product as dU's)
    dW    = du S_inᵀ + bt dM = (du + bt dS_out) S_inᵀ = dU S_inᵀ
    dbt   = W dMᵀ + U dS_outᵀ = u dS_outᵀ
    deC   = diag(dS_out S_inᵀ) = Σ_v dS_out ∘ S_in

so no ``Dk·Dk·Dv`` product is left (``dM`` is never formed): ``Dk·Dv·C`` products only. These are
other sums than the NumPy path's: the compiled backward keeps none of its bits (tested against
the float64 oracle instead).
"""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm, transpose  # noqa: F401  (SGEMM, ILP64: backward)
from ...kernels.flash.compiled import wide_vectors

_MATH = {"contract", "nsz", "reassoc"}   # no NumPy bits to keep
_ZERO = np.float32(0.0)                  # a float64 0.0 beside a float32 makes the sums float64


@numba.njit(inline="always", fastmath=_MATH)
def _state_step(addr, A_qb, W, qt, bt, eC, dO, dS, Y, L, bdS, dS_in):
    """``dS`` (the gradient at the chunk's end, ``dS_out``) made the one at its start, ``dS_in =
    eC ∘ dS + [Qe; W]ᵀ [dO; bt dS]`` with ``Qe = qt + A_qb W``; leaves ``bdS = bt dS``."""
    C, Dk = W.shape
    Dv = dO.shape[1]
    for i in range(C):
        for d in range(Dk):
            L[i, d] = qt[i, d]
            L[C + i, d] = W[i, d]
        for x in range(Dv):
            Y[i, x] = dO[i, x]
    gemm(addr, N_, N_, C, Dk, C, A_qb, W, 1, L[:C])                   # Qe = qt + A_qb W
    gemm(addr, N_, N_, C, Dv, Dk, bt, dS, 0, Y[C:])                   # bt dS
    for i in range(C):
        for x in range(Dv):
            bdS[i, x] = Y[C + i, x]
    gemm(addr, T_, N_, Dk, Dv, 2 * C, L, Y, 0, dS_in)                 # [Qe; W]ᵀ [dO; bt dS]
    for d in range(Dk):
        for x in range(Dv):
            dS_in[d, x] += eC[d] * dS[d, x]


@numba.njit(nogil=True, cache=True, fastmath=_MATH)
def states(addr, W, bt, eC, Hc, S, S_in, WS):
    """The state across a group's chunks (float32, C-contiguous) through ``M``'s structure:
    ``S_out = eC ∘ S_in + btᵀ (W S_in) + Hc``. ``W, bt (B,H,N,C,Dk)``, ``eC (…,Dk)``, ``Hc (…,Dk,Dv)``;
    ``S (B,H,Dk,Dv)`` the state entering the group, out the one leaving it; out ``S_in (…,Dk,Dv)``
    and ``WS = W S_in (…,C,Dv)`` (read again by :func:`chunk_grads`)."""
    wide_vectors()
    B, H, N, C, Dk = W.shape
    Dv = S.shape[-1]
    for b in range(B):
        for h in range(H):
            Sb = S[b, h]
            for n in range(N):
                Si, ws, e = S_in[b, h, n], WS[b, h, n], eC[b, h, n]
                for d in range(Dk):
                    for x in range(Dv):
                        Si[d, x] = Sb[d, x]
                gemm(addr, N_, N_, C, Dv, Dk, W[b, h, n], Si, 0, ws)               # W S_in
                for d in range(Dk):
                    for x in range(Dv):
                        Sb[d, x] = e[d] * Si[d, x] + Hc[b, h, n, d, x]
                gemm(addr, T_, N_, Dk, Dv, C, bt[b, h, n], ws, 1, Sb)              # + btᵀ (W S_in)


@numba.njit(nogil=True, cache=True, fastmath=_MATH)
def chunk_grads(addr, A, P, v, U, WS, W, qt, kt, bt, eC, S_in, dO, dS, dA, dv, dqt, dat, dkt, dbt, deC, halves):
    """A group's chunks backwards (float32, C-contiguous): ``A (B,H,N,2,2,C,C)``, ``P (…,C,C)``,
    ``v, U, WS = W S_in (…,C,Dv)`` (:func:`states`), ``W, qt, kt, bt (…,C,Dk)``, ``eC (…,Dk)``, ``S_in (…,Dk,Dv)``, ``dO (…,C,Dv)``
    (scaled); ``dS (B,H,Dk,Dv)`` the gradient at the group's end, out the one at its start; out
    ``dA (…,2,2,C,C)``, ``dv (…,C,Dv)``, ``dqt, dat, dkt, dbt (…,C,Dk)``, ``deC (…,Dk)``. ``[u; v]``, ``[dO; dU]``,
    ``U``, ``dRv`` and ``W`` are laid out transposed, so no product reads an operand along its rows
    (:func:`qkv.kernels.blas_compiled.transpose`); ``halves`` (:func:`qkv.threads.small_products`): the two
    stacked products against a state made as two of C rows each, as OpenBLAS's small-matrix kernels take them."""
    wide_vectors()
    B, H, N, C, Dk = W.shape
    Dv = v.shape[-1]
    f = np.float32
    Y, L, bdS, dS_in = np.empty((2 * C, Dv), f), np.empty((2 * C, Dk), f), np.empty((C, Dv), f), np.empty((Dk, Dv), f)
    Rt, Gt, Z = np.empty((Dv, 2 * C), f), np.empty((Dv, 2 * C), f), np.empty((2 * C, Dk), f)   # [u; v]ᵀ, [dO; dU]ᵀ
    Ut, dRvT, Wt = np.empty((Dv, C), f), np.empty((Dv, C), f), np.empty((Dk, C), f)
    for b in range(B):
        for h in range(H):
            S = dS[b, h]
            for n in range(N - 1, -1, -1):
                a, Sn, o = A[b, h, n], S_in[b, h, n], dO[b, h, n]
                Wn, Un, vn, ws, dAn = W[b, h, n], U[b, h, n], v[b, h, n], WS[b, h, n], dA[b, h, n]
                for x in range(Dv):
                    for i in range(C):
                        Rt[x, i] = Un[i, x] + ws[i, x]                          # u = U + W S_in
                        Rt[x, C + i] = vn[i, x]
                        Ut[x, i] = Un[i, x]
                        Gt[x, i] = o[i, x]
                transpose(Wn, Wt, 0)
                gemm(addr, N_, N_, C, C, Dv, o, Rt[:, C:], 0, dAn[0, 0])        # dA_qk = dO vᵀ
                gemm(addr, N_, N_, C, C, Dv, o, Rt[:, :C], 0, dAn[0, 1])        # dA_qb = dO uᵀ
                if halves:                                                      # [dbt; dkt] = [u; v] dS_outᵀ
                    gemm(addr, T_, T_, C, Dk, Dv, Rt[:, :C], S, 0, dbt[b, h, n])
                    gemm(addr, T_, T_, C, Dk, Dv, Rt[:, C:], S, 0, dkt[b, h, n])
                else:
                    gemm(addr, T_, T_, 2 * C, Dk, Dv, Rt, S, 0, Z)
                    dbt[b, h, n], dkt[b, h, n] = Z[:C], Z[C:]
                for d in range(Dk):
                    s = f(0.0)
                    for x in range(Dv):
                        s += S[d, x] * Sn[d, x]
                    deC[b, h, n, d] = s                                         # diag(dS_out S_inᵀ)
                _state_step(addr, a[0, 1], Wn, qt[b, h, n], bt[b, h, n], eC[b, h, n], o, S, Y, L, bdS, dS_in)
                transpose(bdS, Gt, C)
                gemm(addr, N_, N_, Dv, C, C, Gt[:, :C], a[0, 1], 1, Gt[:, C:])  # dUᵀ = (A_qbᵀ dO + bt dS_out)ᵀ
                if halves:                                                      # [dqt; dW] = [dO; dU] S_inᵀ
                    gemm(addr, T_, T_, C, Dk, Dv, Gt[:, :C], Sn, 0, dqt[b, h, n])
                    gemm(addr, T_, T_, C, Dk, Dv, Gt[:, C:], Sn, 0, Z[C:])
                else:
                    gemm(addr, T_, T_, 2 * C, Dk, Dv, Gt, Sn, 0, Z)
                    dqt[b, h, n] = Z[:C]
                gemm(addr, N_, N_, Dv, C, C, Gt[:, C:], P[b, h, n], 0, dRvT)    # dRvᵀ = (Pᵀ dU)ᵀ
                gemm(addr, T_, N_, C, Dk, C, P[b, h, n], Z[C:], 0, dat[b, h, n])  # dat = Pᵀ dW
                gemm(addr, T_, N_, C, C, Dv, dRvT, Rt[:, C:], 0, dAn[1, 0])     # dA_ak = dRv vᵀ
                gemm(addr, T_, N_, C, C, Dv, dRvT, Ut, 0, dAn[1, 1])            # dA_ab = dRv Uᵀ
                gemm(addr, N_, N_, C, C, Dk, dat[b, h, n], Wt, 1, dAn[1, 1])    #       + dat Wᵀ
                dvn = dv[b, h, n]
                gemm(addr, T_, N_, C, Dv, C, a[0, 0], o, 0, dvn)                # dv = A_qkᵀ dO
                gemm(addr, N_, N_, C, Dv, Dk, kt[b, h, n], S, 1, dvn)           #    + kt dS_out
                gemm(addr, T_, T_, C, Dv, C, a[1, 0], dRvT, 1, dvn)             #    + A_akᵀ dRv
                for d in range(Dk):
                    for x in range(Dv):
                        S[d, x] = dS_in[d, x]


@numba.njit(inline="always", fastmath=_MATH)
def _column(dA, X, Y, e, s, dX, dY, dg, f, wk, wb, T):
    """Column ``s`` of a chunk's pairs (both row kinds, both column kinds): ``f = exp(G_t - G_s)``
    a running product of the steps' decays down the rows, the q row t and the a row t + 1 (both
    ``tx = t``) read with it; then (3)'s terms of the column, summed over the rows ``tx >= j``."""
    C, Dk = e.shape
    for i in range(Dk):
        f[i], wk[i], wb[i] = 1.0, 0.0, 0.0
    for t in range(s, C):
        cqk, cqb = dA[0, 0, t, s], dA[0, 1, t, s]
        cak, cab = (dA[1, 0, t + 1, s], dA[1, 1, t + 1, s]) if t + 1 < C else (_ZERO, _ZERO)
        xq, dxq, Tt = X[0, t], dX[0, t], T[t]
        if t + 1 < C:
            xa, dxa = X[1, t + 1], dX[1, t + 1]
            for i in range(Dk):
                fq = (cqk * Y[0, s, i] + cqb * Y[1, s, i]) * f[i]
                fa = (cak * Y[0, s, i] + cab * Y[1, s, i]) * f[i]
                dxq[i] += fq
                dxa[i] += fa
                Tt[i] = xq[i] * fq + xa[i] * fa
                wk[i] += (cqk * xq[i] + cak * xa[i]) * f[i]
                wb[i] += (cqb * xq[i] + cab * xa[i]) * f[i]
                f[i] *= e[t + 1, i]
        else:
            for i in range(Dk):
                fq = (cqk * Y[0, s, i] + cqb * Y[1, s, i]) * f[i]
                dxq[i] += fq
                Tt[i] = xq[i] * fq
                wk[i] += cqk * xq[i] * f[i]
                wb[i] += cqb * xq[i] * f[i]
    for i in range(Dk):
        dY[0, s, i] += wk[i]
        dY[1, s, i] += wb[i]
        f[i] = 0.0
    for j in range(C - 1, s, -1):                                   # pairs (t, s) cross j for s < j <= tx
        Tj, dgj = T[j], dg[j]
        for i in range(Dk):
            f[i] += Tj[i]
            dgj[i] += f[i]


@numba.njit(nogil=True, cache=True, fastmath=_MATH)
def scores_backward(dA, X, Y, e, dX, dY, dg):
    """:func:`qkv.recurrent.generalized_delta.scores.scores_backward` with a decay a channel (float32,
    C-contiguous): ``dA (B,H,N,2,2,C,C)``, ``X, Y (…,2,C,Dk)``, ``e (…,C,Dk)``; out ``dX, dY (…,2,C,Dk)``,
    ``dg (…,C,Dk)``. Every pair exactly (``C²·Dk`` multiply-adds a kind pair, no products split at
    reference points): the decays ``exp(Gx_t - G_s)`` running products down each column."""
    wide_vectors()
    B, H, N, _, C, Dk = X.shape
    f32 = np.float32
    f, wk, wb, T = np.empty(Dk, f32), np.empty(Dk, f32), np.empty(Dk, f32), np.empty((C, Dk), f32)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                dXn, dYn, dgn = dX[b, h, n], dY[b, h, n], dg[b, h, n]
                dXn[:] = 0
                dYn[:] = 0
                dgn[:] = 0
                for s in range(C):
                    _column(dA[b, h, n], X[b, h, n], Y[b, h, n], e[b, h, n], s, dXn, dYn, dgn, f, wk, wb, T)
