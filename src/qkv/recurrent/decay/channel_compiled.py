"""numba passes of the decay kernel's backward with a decay a key channel (GLA, RWKV-6), float32; load it
through ``qkv.jit.load(qkv.jit.DECAY_CHANNELS)`` only, driven by :func:`qkv.recurrent.decay.fused.backward_channels`.

The between-chunk products are those of a decay a head (:mod:`qkv.recurrent.decay.compiled`), with the
decays applied element by element: :func:`backward_states` forwards, ``S_{j+1} = exp(Γ_j) ∘ S_j + Kg_jᵀ V_j``,
each chunk's start state stored above its values (``[S_j; V_j]``); :func:`backward_chunks` backwards, each
chunk's gradients while its blocks are in cache, ``[dQg | dA] = dO' [S; V]ᵀ``, ``dKg = V dS'ᵀ``,
``dv = [Kg | Aᵀ] [dS'; dO']``, ``dS = exp(Γ) ∘ dS' + Qgᵀ dO'`` (BLAS's ``sgemm``).

**The decays** are running products of the step decays ``a_t = exp(g_t)`` in [0, 1], none above 1:
``exp(G_i) = Π_{t <= i} a_t``, ``exp(Γ - G_s) = Π_{s < t} a_t``, ``exp(G_i - G_s) = Π_{s < t <= i} a_t``;
a factor below :data:`FLUSH` is 0 (as the NumPy path's :func:`qkv.recurrent.decay.intra.decayed`), so
no product reaches float32's subnormals.

**In the chunk** (:func:`_inside`) no BLAS: row i after row i-1, the factors ``E_s = exp(G_i - G_s)``
``(C, Dk)`` of every earlier row s made from row i-1's (``E_s ∘= a_i``, ``E_i = 1``), and with them, for
``P = dA`` (the scores' gradient, lower triangle)::

    A_is = Σ_d q_id k_sd E_sd             the scores (for dv's Aᵀ dO')
    X_i  = Σ_{s <= i} P_is (k_s ∘ E_s)     dq's in-chunk part
    Y_s += P_is (q_i ∘ E_s)                dk's in-chunk part (every i >= s)
    pairs_j += Σ_{s < j} P_is q_i ∘ k_s ∘ E_s   for s < j <= i: dg's in-chunk part, each pair
                                           added to the steps its factor crosses (qkv.recurrent.crossing)

Then ``dg_j = Σ_{i >= j} dQg_i ∘ Qg_i + Σ_{s < j} dKg_s ∘ Kg_s + exp(Γ) ∘ Σ_v dS'_v S_v + pairs_j``
a key channel each (:mod:`qkv.recurrent.decay.chunk`'s derivation): every summand carries the decays
crossing j, no sum cancels. Bits of their own (float32 sums in other orders): tested against the float64
step oracle (within 2.4x the NumPy float32 path's own error; 5e-7 of each gradient's largest true entry).

Cost: five products a chunk (6.3 M multiply-adds at C = 64, D = 128) and ``C²/2 · Dk`` steps of the row
loop (0.5 ns a step on Zen 3, vectorised over the key channels: about 32 ms of the backward at
(1, 8, 2048, 128), where the NumPy path's in-chunk gradients took about 120).
"""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm  # noqa: F401  (SGEMM, ILP64: read by decay_fused)
from ...kernels.flash.compiled import wide_vectors

FLUSH = np.float32(2.0 ** -60)      # a decay factor below is 0 (qkv.recurrent.decay.intra.FLUSH)
_BACK = {"contract", "nsz", "reassoc"}   # no NumPy bits to match


@numba.njit(inline="always", fastmath=_BACK)
def running_factors(a, eG, eK):
    """A chunk's ``eG[i] = Π_{t <= i} a_t``, ``eK[s] = Π_{s < t} a_t`` ``(C, Dk)``; returns ``exp(Γ) = eG[C-1]``."""
    C, Dk = a.shape
    for d in range(Dk):
        eG[0, d] = a[0, d] if a[0, d] >= FLUSH else 0
        eK[C - 1, d] = 1
    for i in range(1, C):
        for d in range(Dk):
            x = eG[i - 1, d] * a[i, d]
            eG[i, d] = x if x >= FLUSH else 0
    for s in range(C - 2, -1, -1):
        for d in range(Dk):
            x = eK[s + 1, d] * a[s + 1, d]
            eK[s, d] = x if x >= FLUSH else 0
    return eG[C - 1]


@numba.njit(inline="always", fastmath=_BACK)
def _times(x, e, out):
    """``out = x ∘ e`` (all ``(C, D)``)."""
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            out[i, d] = x[i, d] * e[i, d]


@numba.njit(nogil=True, cache=True, fastmath=_BACK)
def backward_states(addr, k, v, a, S0, starts):
    """The first sweep, chunks forwards: ``starts[h, j] = [S_j; V_j]`` ``(n, Nc, Dk + C, Dv)``, the state
    entering chunk j above its values, ``S_{j+1} = exp(Γ_j) ∘ S_j + Kg_jᵀ V_j`` from ``S0 (n, Dk, Dv)``.
    ``k, a (n, Nc, C, Dk)``, ``v (n, Nc, C, Dv)``."""
    wide_vectors()
    n, Nc, C, Dk = k.shape
    Dv = v.shape[3]
    Kg, eG, eK = np.empty((C, Dk), np.float32), np.empty((C, Dk), np.float32), np.empty((C, Dk), np.float32)
    for h in range(n):
        starts[h, 0, :Dk] = S0[h]
        for j in range(Nc):
            starts[h, j, Dk:] = v[h, j]
            if j + 1 < Nc:
                e_gam = running_factors(a[h, j], eG, eK)
                _times(k[h, j], eK, Kg)
                S, out = starts[h, j, :Dk], starts[h, j + 1, :Dk]
                for d in range(Dk):
                    e = e_gam[d]
                    for x in range(Dv):
                        out[d, x] = e * S[d, x]
                gemm(addr, T_, N_, Dk, Dv, C, Kg, v[h, j], 1, out)          # S_{j+1} = exp(Γ) ∘ S_j + Kgᵀ V


@numba.njit(inline="always", fastmath=_BACK)
def _inside(q, k, a, dA, E, Y, pairs, run, A, dq):
    """The chunk's in-chunk part, row after row (the module's docstring): ``A (C, C)`` the scores (lower
    triangle), ``dq (C, Dk)`` += X, ``Y`` and ``pairs (C, Dk)`` (zeroed here) the cols and the pairs.
    ``E, run (·, Dk)`` scratch."""
    C, Dk = q.shape
    Y[:] = 0
    pairs[:] = 0
    for i in range(C):
        qi, ai, Xi = q[i], a[i], dq[i]
        run[:] = 0
        for s in range(i):
            P, Es, ks, Ys, ps = dA[i, s], E[s], k[s], Y[s], pairs[s + 1]
            acc = np.float32(0)
            for d in range(Dk):
                e = Es[d] * ai[d]
                e = e if e >= FLUSH else np.float32(0)
                Es[d] = e
                w = ks[d] * e                                              # k_s ∘ E_s
                m = qi[d] * w                                              # q_i ∘ k_s ∘ E_s
                acc += m
                Xi[d] += P * w
                Ys[d] += P * (qi[d] * e)
                run[d] += P * m
                ps[d] += run[d]                                            # pairs_{s+1}: Σ_{s' <= s} of row i
            A[i, s] = acc
        P, ki, acc = dA[i, i], k[i], np.float32(0)                        # the diagonal: E = 1, crossing nothing
        for d in range(Dk):
            E[i, d] = 1
            acc += qi[d] * ki[d]
            Xi[d] += P * ki[d]
            Y[i, d] += P * qi[d]
        A[i, i] = acc
        for s in range(i + 1, C):
            A[i, s] = 0


@numba.njit(inline="always", fastmath=_BACK)
def _rows(R, dKg, Qg, Kg, eG, eK, whole, Y, pairs, dq, dk, dg, later):
    """``dq = eG ∘ dQg + X`` (X in dq), ``dk = eK ∘ dKg + Y``, ``dg_j = Σ_{i >= j} dQg_i ∘ Qg_i +
    Σ_{s < j} dKg_s ∘ Kg_s + whole + pairs_j``; ``later (Dk,)`` scratch."""
    C, Dk = dq.shape
    later[:] = 0
    for i in range(C - 1, -1, -1):
        for d in range(Dk):
            x = R[i, d]
            later[d] += x * Qg[i, d]
            dq[i, d] += eG[i, d] * x
            dk[i, d] = eK[i, d] * dKg[i, d] + Y[i, d]
            dg[i, d] = later[d] + whole[d] + pairs[i, d]
    later[:] = 0
    for s in range(C):
        for d in range(Dk):
            dg[s, d] += later[d]
            later[d] += dKg[s, d] * Kg[s, d]


@numba.njit(nogil=True, cache=True, fastmath=_BACK)
def backward_chunks(addr, q, k, v, dO, a, starts, scale, dS, dq, dk, dv, dg):
    """The second sweep, chunks backwards, each chunk's gradients while its blocks are in cache. ``q, k, a,
    dq, dk, dg (n, Nc, C, Dk)``, ``v, dO, dv (n, Nc, C, Dv)``, ``starts`` from :func:`backward_states`;
    ``dS (n, Dk, Dv)`` the final state's gradient, the initial's on return."""
    wide_vectors()
    n, Nc, C, Dk = q.shape
    Dv = v.shape[3]
    f4 = np.float32
    Z, L, R = np.empty((Dk + C, Dv), f4), np.zeros((C, Dk + C), f4), np.empty((C, Dk + C), f4)
    A, Qg, dKg, eG, eK = (np.zeros((C, C), f4), np.empty((C, Dk), f4), np.empty((C, Dk), f4),
                          np.empty((C, Dk), f4), np.empty((C, Dk), f4))
    E, Y, pairs, run, whole = (np.empty((C, Dk), f4), np.empty((C, Dk), f4), np.empty((C, Dk), f4),
                               np.empty(Dk, f4), np.empty(Dk, f4))
    for h in range(n):
        Z[:Dk] = dS[h]                                                     # Z = [dS'; dO']
        for j in range(Nc - 1, -1, -1):
            Q, K, V, st, dSn, dOn, Kg = q[h, j], k[h, j], v[h, j], starts[h, j], Z[:Dk], Z[Dk:], L[:, :Dk]
            for i in range(C):
                for x in range(Dv):
                    dOn[i, x] = dO[h, j, i, x] * scale
            e_gam = running_factors(a[h, j], eG, eK)
            _times(K, eK, Kg)                                              # L = [Kg | Aᵀ]
            _times(Q, eG, Qg)
            gemm(addr, N_, T_, C, Dk + C, Dv, dOn, st, 0, R)              # [dQg | dA] = dO' [S; V]ᵀ
            gemm(addr, N_, T_, C, Dk, Dv, V, dSn, 0, dKg)                 # dKg = V dS'ᵀ
            for i in range(C):
                for d in range(Dk):
                    dq[h, j, i, d] = 0
            _inside(Q, K, a[h, j], R[:, Dk:], E, Y, pairs, run, A, dq[h, j])
            for s in range(C):
                for t in range(C):
                    L[s, Dk + t] = A[t, s]
            gemm(addr, N_, N_, C, Dv, Dk + C, L, Z, 0, dv[h, j])          # dv = Kg dS' + Aᵀ dO'
            for d in range(Dk):
                part, e = f4(0), e_gam[d]
                for x in range(Dv):
                    part += dSn[d, x] * st[d, x]
                    dSn[d, x] *= e
                whole[d] = part * e                                        # exp(Γ) ∘ Σ_v dS'_v S_v
            gemm(addr, T_, N_, Dk, Dv, C, Qg, dOn, 1, dSn)                # dS = exp(Γ) ∘ dS' + Qgᵀ dO'
            _rows(R, dKg, Qg, Kg, eG, eK, whole, Y, pairs, dq[h, j], dk[h, j], dg[h, j], run)
        dS[h] = Z[:Dk]
