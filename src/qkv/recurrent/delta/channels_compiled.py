"""numba forward of the delta rule with a decay a key channel (Kimi Delta Attention), float32; load it
through ``qkv.jit.load(qkv.jit.DELTA_CHANNELS)`` only, driven by :func:`qkv.recurrent.delta.channels.forward`.

The NumPy path (:mod:`qkv.recurrent.delta.channels`) makes every chunk's ``(C, C, Dk)`` block of decays
``e^{Γ_td - Γ_sd}`` at once, by ``exp`` of float64 differences, then contracts it by batched products: at
(1, 8, 2048, 64) about 100 ms, most of it those blocks' exps and passes over memory. Here a head's chunks run
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

Bits of its own (float32 sums in other orders, the decays running products): tested against the float64 step
oracle within the NumPy float32 path's budget. Cost a chunk: ``C²/2 · Dk`` steps of the row loop (vectorised
over the key channels) and ``3 C Dk Dv + 2 C² Dv`` multiply-adds in the products.
"""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm  # noqa: F401  (SGEMM, ILP64: read by channels)
from ...kernels.flash.compiled import wide_vectors
from ..decay.channel_compiled import FLUSH, _factors
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
    KK, P, tmp = np.empty((C, C), f32), np.empty((C, C), f32), np.empty(C, f32)
    reads, R, U, X = np.empty((2 * C, Dv), f32), np.empty((C, Dv), f32), np.empty((C, Dv), f32), np.empty((Dk, Dv), f32)
    for h in range(n):
        st = S[h]
        for t0 in range(0, T, C):
            c = min(C, T - t0)
            Q, K, V, G, B, O = q[h, t0:t0 + c], k[h, t0:t0 + c], v[h, t0:t0 + c], g[h, t0:t0 + c], beta[h, t0:t0 + c], o[h, t0:t0 + c]
            ac, eGc, eKc, kk, pp, rd = a[:c], eG[:c], eK[:c], KK[:c, :c], P[:c, :c], reads[:2 * c]
            for i in range(c):
                for d in range(Dk):
                    ac[i, d] = decay_factor(np.float64(G[i, d]), True)
            _factors(ac, eGc, eKc)
            for i in range(c):
                for d in range(Dk):
                    e = eGc[i, d]
                    KQg[i, d] = K[i, d] * e
                    KQg[c + i, d] = Q[i, d] * e
                    Kc[i, d] = K[i, d] * eKc[i, d]
            _scores(Q, K, ac, E, kk, pp)
            for i in range(c):                                              # A = diag(beta) KK, then (I + A)⁻¹
                for s in range(i):
                    kk[i, s] *= B[i]
            _invert(kk, tmp, FLUSH)
            gemm(addr, N_, N_, 2 * c, Dv, Dk, KQg, st, 0, rd)                # [Kg S_0; Qg S_0]
            for i in range(c):                                              # diag(beta) (V - Kg S_0)
                for x in range(Dv):
                    R[i, x] = B[i] * (V[i, x] - rd[i, x])
            gemm(addr, N_, N_, c, Dv, c, kk, R, 0, U)                       # U = Tinv R
            gemm(addr, N_, N_, c, Dv, c, pp, U, 0, O)                       # O = (P U + Qg S_0) · scale
            for i in range(c):
                for x in range(Dv):
                    O[i, x] = (O[i, x] + rd[c + i, x]) * scale
            gemm(addr, T_, N_, Dk, Dv, c, Kc, U, 0, X)                      # Kcᵀ U
            for d in range(Dk):                                             # S = diag(e^{Γ_C}) S + Kcᵀ U
                e = eGc[c - 1, d]
                for x in range(Dv):
                    st[d, x] = e * st[d, x] + X[d, x]
