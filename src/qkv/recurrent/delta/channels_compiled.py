"""numba forward and backward of the delta rule with a decay a key channel (Kimi Delta Attention), float32;
load it through ``qkv.jit.load(qkv.jit.DELTA_CHANNELS)`` only, driven by :mod:`qkv.recurrent.delta.channels`.

The NumPy path (:mod:`qkv.recurrent.delta.channels`) makes every chunk's ``(C, C, Dk)`` block of decays
``e^{Γ_td - Γ_sd}`` at once, by ``exp`` of float64 differences, then contracts it by batched products: at
(1, 8, 2048, 64) 100-160 ms, most of it those blocks' exps and passes over memory. Here a head's chunks run
one after the other, each in cache, the state passed by BLAS's ``sgemm`` (the products of
:mod:`qkv.recurrent.delta.channels`' ``pass_states`` and the output's)::

    [Kg S_0; Qg S_0] = [Kg; Qg] S_0                         (2C, Dk) @ (Dk, Dv)
    U   = Tinv diag(beta) (V - Kg S_0)                      (C, C) @ (C, Dv)
    O   = scale · (P U + Qg S_0)                            (C, C) @ (C, Dv)
    S_C = diag(e^{Γ_C}) S_0 + Kcᵀ U                          (C, Dk)ᵀ @ (C, Dv), Kc read in place

**The decays** are running products of the step decays ``a_t = e^{g_t}`` in [0, 1] (a polynomial ``exp``,
:func:`qkv.recurrent.delta.compiled.decay_factor`), as the decay kernel's channel backward makes them
(:mod:`qkv.recurrent.decay.channel_compiled`): ``e^{Γ_t} = Π_{j <= t} a_j``, ``e^{Γ_C - Γ_t} = Π_{j > t} a_j``,
and in the scores, row t after row t-1, the factors ``E_s = e^{Γ_t - Γ_s}`` of every earlier row made from
row t-1's (``E_s ∘= a_t``, ``E_t = 1``)::

    KK_ts = Σ_d k_td k_sd E_sd  (s < t)        P_ts = Σ_d q_td k_sd E_sd  (s <= t)

No exponent is positive and no factor above 1 is formed, so steep decays (-30 a step, resets) underflow to
0 and nothing overflows; a factor below :data:`FLUSH` is 0, so no product reaches float32's subnormals.
``Tinv = (I + strictly_lower(diag(beta) KK))⁻¹`` by forward substitution
(:func:`qkv.recurrent.delta.compiled._invert`, its entries below ``FLUSH`` 0 as there).

**The backward** (:func:`backward`, the derivation in :mod:`qkv.recurrent.delta.channels`), a head at a time:
a sweep forwards keeps each chunk's start state, ``U`` and ``V - Kg S_0`` (``(T/C)·Dk·Dv + 2·T·Dv`` numbers a
head), a sweep backwards makes each chunk's quantities again and its gradients from nine products, then
(:func:`_rows`) the in-chunk sums through the decays row by row with the factors ``E_s`` made again, and the
decays' gradient as sums over the steps each factor crosses (:mod:`qkv.recurrent.crossing`), in float64.

Bits of their own (float32 sums in other orders, the decays running products): tested against the float64
step oracle within the NumPy float32 path's budget. Cost a chunk: ``C²/2 · Dk`` steps of the row loop
(vectorised over the key channels) and ``3 C Dk Dv + 2 C² Dv`` multiply-adds in the forward's products.
Measured at (1, 8, 2048, D), one thread, Intel Xeon model 207 (AVX-512), C = 16: forward 7-9 ms at D = 64,
20-24 at 128 (the NumPy path 157 at 64); backward 33-39 and 93-99 ms (the NumPy path 395 at 64). The backward's
start states are written row by row (a column at a time, 8 MB a head at D = 128, they took 13 ms more) and
``U`` kept transposed (``U dS'ᵀ`` read along rows took 10 µs a chunk where this takes 6).
"""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm, transpose  # noqa: F401  (SGEMM, ILP64: read by channels)
from ...kernels.flash.compiled import wide_vectors
from ..decay.channel_compiled import FLUSH, running_factors
from .compiled import _invert, decay_factor

_MATH = {"contract", "nsz", "reassoc"}   # no NumPy bits to match
f32 = np.float32


@numba.njit(inline="always", fastmath=_MATH)
def _scores(Q, K, a, E, KK, P):
    """A chunk's ``KK`` (strictly lower; 0 on and above the diagonal) and ``P`` (lower; 0 above) ``(c, c)``
    (module docstring), ``E (c, Dk)`` the running factors; ``a (c, Dk)`` the step decays."""
    c, Dk = Q.shape
    for t in range(c):
        for s in range(t):
            kk, p = f32(0), f32(0)
            for d in range(Dk):
                x = E[s, d] * a[t, d]
                x = x if x >= FLUSH else f32(0)
                E[s, d] = x
                w = K[s, d] * x
                kk += K[t, d] * w
                p += Q[t, d] * w
            KK[t, s], P[t, s] = kk, p
        p = f32(0)
        for d in range(Dk):
            E[t, d] = 1
            p += Q[t, d] * K[t, d]
        P[t, t] = p
        for s in range(t, c):
            KK[t, s] = 0
        for s in range(t + 1, c):
            P[t, s] = 0


@numba.njit(inline="always", fastmath=_MATH)
def _setup(Q, K, G, B, a, eG, eK, E, KQg, Kc, KK, P, Tinv, tmp):
    """A chunk of ``c`` rows (the views' lengths): the step decays ``a``, ``eG = e^{Γ}``, ``eK = e^{Γ_C - Γ}``,
    ``KQg = [Kg; Qg]`` (its first ``2c`` rows), ``Kc``, the scores ``KK`` and ``P``, ``Tinv = (I + A)⁻¹``."""
    c, Dk = Q.shape
    for i in range(c):
        for d in range(Dk):
            a[i, d] = decay_factor(np.float64(G[i, d]), True)
    running_factors(a, eG, eK)
    for i in range(c):
        for d in range(Dk):
            e = eG[i, d]
            KQg[i, d] = K[i, d] * e
            KQg[c + i, d] = Q[i, d] * e
            Kc[i, d] = K[i, d] * eK[i, d]
    _scores(Q, K, a, E, KK, P)
    for i in range(c):                                                      # A = diag(beta) KK, then (I + A)⁻¹
        for s in range(i):
            Tinv[i, s] = B[i] * KK[i, s]
    _invert(Tinv, tmp, FLUSH)


@numba.njit(inline="always", fastmath=_MATH)
def _corrections(addr, KQg, st, V, B, Tinv, rd, R, U):
    """``rd = [Kg S_0; Qg S_0]``, ``R = V - Kg S_0`` and ``U = Tinv diag(beta) R`` of a chunk."""
    c, Dv = V.shape
    gemm(addr, N_, N_, 2 * c, Dv, KQg.shape[1], KQg, st, 0, rd)
    for i in range(c):
        for x in range(Dv):
            R[i, x] = V[i, x] - rd[i, x]
            rd[i, x] = B[i] * R[i, x]
    gemm(addr, N_, N_, c, Dv, c, Tinv, rd[:c], 0, U)


@numba.njit(inline="always", fastmath=_MATH)
def _pass(addr, Kc, U, eC, st, X):
    """``S = diag(e^{Γ_C}) S + Kcᵀ U`` in place."""
    Dk, Dv = st.shape
    gemm(addr, T_, N_, Dk, Dv, U.shape[0], Kc, U, 0, X)
    for d in range(Dk):
        e = eC[d]
        for x in range(Dv):
            st[d, x] = e * st[d, x] + X[d, x]


@numba.njit(nogil=True, cache=True, fastmath=_MATH)
def forward(addr, q, k, v, beta, g, S, o, scale, C):
    """The forward of every head, chunks of ``C`` rows (the last may be shorter): ``q, k, g (n, T, Dk)``,
    ``v, o (n, T, Dv)``, ``beta (n, T)``, float32 and C-contiguous; ``S (n, Dk, Dv)`` the start states in,
    the final states out; ``o`` the outputs, written."""
    wide_vectors()
    n, T, Dk = q.shape
    Dv = v.shape[2]
    a, eG, eK, E = np.empty((C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32)
    KQg, Kc = np.empty((2 * C, Dk), f32), np.empty((C, Dk), f32)
    KK, P, Tinv, tmp = np.empty((C, C), f32), np.empty((C, C), f32), np.empty((C, C), f32), np.empty(C, f32)
    rd, R, U, X = np.empty((2 * C, Dv), f32), np.empty((C, Dv), f32), np.empty((C, Dv), f32), np.empty((Dk, Dv), f32)
    for h in range(n):
        st = S[h]
        for t0 in range(0, T, C):
            c = min(C, T - t0)
            O = o[h, t0:t0 + c]
            _setup(q[h, t0:t0 + c], k[h, t0:t0 + c], g[h, t0:t0 + c], beta[h, t0:t0 + c], a[:c], eG[:c], eK[:c],
                   E[:c], KQg, Kc[:c], KK[:c, :c], P[:c, :c], Tinv[:c, :c], tmp)
            _corrections(addr, KQg[:2 * c], st, v[h, t0:t0 + c], beta[h, t0:t0 + c], Tinv[:c, :c], rd[:2 * c], R[:c],
                         U[:c])
            gemm(addr, N_, N_, c, Dv, c, P[:c, :c], U[:c], 0, O)               # O = (P U + Qg S_0) · scale
            for i in range(c):
                for x in range(Dv):
                    O[i, x] = (O[i, x] + rd[c + i, x]) * scale
            _pass(addr, Kc[:c], U[:c], eG[c - 1], st, X)


@numba.njit(inline="always", fastmath=_MATH)
def _rows(Q, K, a, E, B, KQg, Kc, eG, eK, KK, Z, ZS, ZU, R, dKc, whole, acc, cross, run, dq, dk, dv, dbeta, dg):
    """A chunk's gradients from its products (``backward``): the in-chunk sums row by row with the factors
    ``E_s = e^{Γ_t - Γ_s}`` made again as the forward made them, then every row's ``dq, dk, dv, dbeta`` and
    ``dg`` (float64 sums over the steps each factor crosses). ``acc (3, c, Dk)``: ``Σ_s dP_ts W_ts``,
    ``Σ_s Gk_ts W_ts`` and ``Σ_t Y_ts``; ``cross (c, Dk)`` float64: the pairs' share of dg."""
    c, Dk = Q.shape
    Dv = Z.shape[1]
    acc[:] = 0
    cross[:] = 0
    for t in range(c):
        bt = B[t]
        for d in range(Dk):
            run[d] = 0
        for s in range(t + 1):
            dp = ZU[t, s]                                                   # dP_ts
            gk = -bt * ZU[c + t, s] if s < t else f32(0)                    # Gk_ts = beta_t dA_ts
            for d in range(Dk):
                if s < t:
                    x = E[s, d] * a[t, d]
                    e = x if x >= FLUSH else f32(0)
                    E[s, d] = e
                else:
                    e = f32(1)
                    E[s, d] = e
                w = K[s, d] * e
                acc[0, t, d] += dp * w
                acc[1, t, d] += gk * w
                y = e * (gk * K[t, d] + dp * Q[t, d])
                acc[2, s, d] += y
                if s < t:
                    run[d] += np.float64(y * K[s, d])
                    cross[s + 1, d] += run[d]
        db = f32(0)
        for x in range(Dv):
            db += Z[c + t, x] * R[t, x]
            dv[t, x] = bt * Z[c + t, x]
        for s in range(t):
            db -= ZU[c + t, s] * KK[t, s]
        dbeta[t] = db
    for d in range(Dk):
        run[d] = 0                                                          # Σ_{t >= j} after_t
    for j in range(c - 1, -1, -1):
        for d in range(Dk):
            dQg, dKg = ZS[j, d], -B[j] * ZS[c + j, d]
            dq[j, d] = eG[j, d] * dQg + acc[0, j, d]
            dk[j, d] = eG[j, d] * dKg + eK[j, d] * dKc[j, d] + acc[1, j, d] + acc[2, j, d]
            run[d] += np.float64(KQg[c + j, d] * dQg + KQg[j, d] * dKg)
            cross[j, d] += run[d] + whole[d]
    for d in range(Dk):
        run[d] = 0                                                          # Σ_{t < j} before_t
    for j in range(c):
        for d in range(Dk):
            dg[j, d] = cross[j, d] + run[d]
            run[d] += np.float64(Kc[j, d] * dKc[j, d])


@numba.njit(nogil=True, cache=True, fastmath=_MATH)
def backward(addr, q, k, v, beta, g, dO, S0, dS, scale, C, starts, Ut, Rs, dq, dk, dv, dbeta, dg):
    """The gradients of :func:`forward` (inputs as there; ``dO (n, T, Dv)``, ``S0 (n, Dk, Dv)`` the start
    states) written into ``dq, dk, dg (n, T, Dk)``, ``dv (n, T, Dv)``, ``dbeta (n, T)``; ``dS (n, Dk, Dv)`` the
    final states' gradients in, the start states' out. A head at a time: a sweep forwards keeps each chunk's
    start state and ``U``, both transposed (``starts (N, Dv, Dk)``, ``Ut (N, Dv, C)``: no product reads an operand
    along its rows, which OpenBLAS's small AVX-512 kernels run at a third of the speed), and ``V - Kg S_0``
    (``Rs (T, Dv)``), a sweep
    backwards makes each chunk's gradients (the products of :func:`qkv.recurrent.delta.channels.backward`)::

        dKc = U dS'ᵀ    dU = Pᵀ dO' + Kc dS'    dR = Tinvᵀ dU    dS = e^{Γ_C} ∘ dS' + Qgᵀ dO' - (beta ∘ Kg)ᵀ dR
        [dQg; dR S_0ᵀ] = [dO'; dR] S_0ᵀ         [dP; -dA] = [dO'; dR] Uᵀ      (dO' = scale · dO)"""
    wide_vectors()
    n, T, Dk = q.shape
    Dv = v.shape[2]
    a, eG, eK, E = np.empty((C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32)
    KQg, Kc, Kb, dKc = np.empty((2 * C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32), np.empty((C, Dk), f32)
    KK, P, Tinv, tmp = np.empty((C, C), f32), np.empty((C, C), f32), np.empty((C, C), f32), np.empty(C, f32)
    rd, X, st = np.empty((2 * C, Dv), f32), np.empty((Dk, Dv), f32), np.empty((Dk, Dv), f32)
    Z, ZS, ZU, dU = np.empty((2 * C, Dv), f32), np.empty((2 * C, Dk), f32), np.empty((2 * C, C), f32), np.empty((C, Dv), f32)
    U = np.empty((C, Dv), f32)
    acc, cross, run, whole = np.empty((3, C, Dk), f32), np.empty((C, Dk)), np.empty(Dk), np.empty(Dk)
    for h in range(n):
        st[:] = S0[h]
        for j, t0 in enumerate(range(0, T, C)):                             # forwards: the start states, U, V - Kg S_0
            c = min(C, T - t0)
            transpose(st, starts[j], 0)                                     # S_0ᵀ, written row by row
            _setup(q[h, t0:t0 + c], k[h, t0:t0 + c], g[h, t0:t0 + c], beta[h, t0:t0 + c], a[:c], eG[:c], eK[:c],
                   E[:c], KQg, Kc[:c], KK[:c, :c], P[:c, :c], Tinv[:c, :c], tmp)
            _corrections(addr, KQg[:2 * c], st, v[h, t0:t0 + c], beta[h, t0:t0 + c], Tinv[:c, :c], rd[:2 * c],
                         Rs[t0:t0 + c], U[:c])
            _pass(addr, Kc[:c], U[:c], eG[c - 1], st, X)
            transpose(U[:c], Ut[j], 0)
        dSh = dS[h]
        for j in range(-(-T // C) - 1, -1, -1):                            # backwards: each chunk's gradients
            t0 = j * C
            c = min(C, T - t0)
            Q, K, B, UT, S0T = q[h, t0:t0 + c], k[h, t0:t0 + c], beta[h, t0:t0 + c], Ut[j, :, :c], starts[j]
            _setup(Q, K, g[h, t0:t0 + c], B, a[:c], eG[:c], eK[:c], E[:c], KQg, Kc[:c], KK[:c, :c], P[:c, :c],
                   Tinv[:c, :c], tmp)
            Dh = dO[h, t0:t0 + c]
            for i in range(c):
                for x in range(Dv):
                    Z[i, x] = scale * Dh[i, x]
            for d in range(Dk):                                             # e^{Γ_C} Σ_v dS' ∘ S_0: every step
                part = f32(0)
                for x in range(Dv):
                    part += dSh[d, x] * S0T[x, d]
                whole[d] = np.float64(eG[c - 1, d] * part)
            gemm(addr, T_, T_, c, Dk, Dv, UT, dSh, 0, dKc[:c])              # dKc = U dS'ᵀ
            gemm(addr, T_, N_, c, Dv, c, P[:c, :c], Z[:c], 0, dU[:c])       # dU = Pᵀ dO' + Kc dS'
            gemm(addr, N_, N_, c, Dv, Dk, Kc[:c], dSh, 1, dU[:c])
            gemm(addr, T_, N_, c, Dv, c, Tinv[:c, :c], dU[:c], 0, Z[c:2 * c])  # dR = Tinvᵀ dU
            for i in range(c):
                for d in range(Dk):
                    Kb[i, d] = -B[i] * KQg[i, d]
            for d in range(Dk):                                             # dS = e^{Γ_C} dS' + Qgᵀ dO' - (beta Kg)ᵀ dR
                e = eG[c - 1, d]
                for x in range(Dv):
                    dSh[d, x] *= e
            gemm(addr, T_, N_, Dk, Dv, c, KQg[c:2 * c], Z[:c], 1, dSh)
            gemm(addr, T_, N_, Dk, Dv, c, Kb[:c], Z[c:2 * c], 1, dSh)
            gemm(addr, N_, N_, 2 * c, Dk, Dv, Z[:2 * c], S0T, 0, ZS[:2 * c])  # [dQg; dR S_0ᵀ]
            gemm(addr, N_, N_, 2 * c, c, Dv, Z[:2 * c], UT, 0, ZU[:2 * c, :c])  # [dP; -dA] (above the diagonal unread)
            _rows(Q, K, a[:c], E[:c], B, KQg[:2 * c], Kc[:c], eG[:c], eK[:c], KK[:c, :c], Z[:2 * c], ZS[:2 * c],
                  ZU[:2 * c, :c], Rs[t0:t0 + c], dKc[:c], whole, acc[:, :c], cross[:c], run, dq[h, t0:t0 + c],
                  dk[h, t0:t0 + c], dv[h, t0:t0 + c], dbeta[h, t0:t0 + c], dg[h, t0:t0 + c])
