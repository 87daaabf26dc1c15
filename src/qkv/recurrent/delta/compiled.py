"""numba passes of the delta-rule kernel (:mod:`qkv.recurrent.delta.chunk_parts`); load it through
``qkv.jit.load(qkv.jit.DELTA)`` only.

:func:`chunk_systems`: every chunk's in-chunk quantities in one pass a chunk, from the scores
``[K Kᵀ; Q Kᵀ]`` and the cumulative log decays: the decays ``D_ts = e^{γ_t - γ_s}`` (formed
row by row, never stored unless the backward asks), the masked scores ``P = (Q Kᵀ) ∘ D`` in
place, and ``(I + A)⁻¹`` with ``A = strictly_lower(diag(beta) (K Kᵀ) ∘ D)``. NumPy's path takes
six passes over ``(C, C)`` blocks of every chunk and three temporaries (at (1, 8, 2048, 64)
float32 they were 8 of its 60 ms as AVX2).

The decays in float32 are the flash kernel's ``2^x`` polynomial (:data:`COEF`, about 1 ulp),
its argument ``(γ_t - γ_s) log2 e`` formed and split in float64: NumPy's ``exp`` of the
difference rounded to float32 first loses ``|γ_t - γ_s|`` ulps of it (at a difference of -30,
about 8 ulps of the decay). ``D_tt = 1`` exactly; float64 takes ``math.exp``.

**Subnormals.** In float32 a decay, an entry of ``A`` or of ``(I + A)⁻¹`` below :data:`FLUSH`
(``2^-60``) is taken as 0. Each is ``2^-36`` below float32's resolution of the sums it enters
(every row of ``(I + A)⁻¹`` holds a 1, ``ε = 2^-24``), and the product of two of them stays out
of float32's subnormal range, where Intel's cores take a microcode assist an operation. With
transformers' initial decays (``A`` up to 16, ``dt ≈ 1``: steps near -20) one entry in 60 of
``(I + A)⁻¹`` was subnormal and the forward took twice the time, all of it in the products
that read them. float64 flushes nothing.

The inverse, by forward substitution, a row at a time in ``A``'s place:
``X_i = e_iᵀ - A[i, :i] X[:i]`` (row i of ``X (I + A) = I``). Each row is a sum of the rows
above it, a vector loop of C numbers (the rows above are zero past their diagonal); NumPy's
path doubles the inverted blocks instead, in ``log2 C`` rounds of small batched products.

**The backward** (float32, :mod:`.backward`): :func:`backward_states` takes each chunk through :func:`chunk_systems`'
and :func:`pass_chunks`' steps in one sweep, :func:`backward_chunks` the chunks backwards; neither keeps NumPy's bits.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm, transpose  # noqa: F401  (SGEMM, ILP64: delta_chunks)
from ...kernels.flash.compiled import COEF, wide_vectors
from ..crossing_compiled import decay_grads

_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (np.float32(c) for c in COEF)
_LOG2E = 1.4426950408889634
FLUSH = 2.0 ** -60  # float32: a decay, an entry of A or of (I + A)⁻¹ below it is 0 (module docstring);
                    # decay_intra.FLUSH, the NumPy side's, is the same (a test holds them equal)


@numba.njit(inline="always", fastmath={"contract", "nsz"})
def decay_factor(x, single):
    """``e^x`` for ``x <= 0`` (float64): float32's polynomial when ``single`` (0 below ``2^-60``:
    :data:`FLUSH`), else ``math.exp``."""
    if not single:
        return math.exp(x)
    y = x * _LOG2E
    if y < -60.0:
        return np.float32(0.0)
    n = np.floor(y + 0.5)
    f = np.float32(y - n)                                        # in [-1/2, 1/2]
    p = ((((((_E6 * f + _E5) * f + _E4) * f + _E3) * f + _E2) * f + _E1) * f + _E0)
    bits = (np.int32(n) + np.int32(127)) << np.int32(23)         # 2^n as float bits (n >= -60)
    return p * np.int32(bits).view(np.float32)


@numba.njit(inline="always", fastmath={"contract", "nsz"})
def _invert(x, a, flush):
    """``x (C, C)`` replaced by ``(I + tril(x, -1))⁻¹``; ``a (C,)`` scratch; entries of ``x`` and of
    the inverse below ``flush`` in magnitude made 0 as they are read and made (0: none)."""
    C = x.shape[0]
    for i in range(C):
        row = x[i]
        for k in range(i):
            a[k] = 0 if abs(row[k]) < flush else -row[k]       # NaN kept
        for j in range(C):
            row[j] = 0
        row[i] = 1
        for k in range(i):
            src, f = x[k], a[k]
            for j in range(C):              # src[j] = 0 for j > k: a fixed-length vector loop
                row[j] += f * src[j]
        if flush > 0:
            for j in range(i):
                if abs(row[j]) < flush:
                    row[j] = 0


@numba.njit(nogil=True, cache=True, fastmath={"contract", "nsz"})
def unit_lower_inverse(A):
    """``A (M, C, C)`` C-contiguous: each ``A[m]`` replaced by ``(I + tril(A[m], -1))⁻¹`` (what is
    on and above the diagonal is not read)."""
    wide_vectors()
    a = np.empty(A.shape[2], A.dtype)
    for m in range(A.shape[0]):
        _invert(A[m], a, 0.0)


@numba.njit(inline="always", fastmath={"contract", "nsz"})
def _system(kk, qk, gam, beta, x, D, keep, d, a, single, decayed=True):
    """One chunk of :func:`chunk_systems`: ``qk`` made ``P``, ``x`` ``(I + A)⁻¹``, ``D`` the decays where
    ``keep`` (without ``decayed``, 1 on and below the diagonal: what ``γ = 0`` gives, exactly)."""
    C = gam.shape[0]
    for t in range(C):
        for s in range(t + 1):
            d[s] = decay_factor(gam[t] - gam[s], single) if decayed else 1
        for s in range(t + 1, C):
            d[s] = 0
        bt, xt, pt = beta[t], x[t], qk[t]
        for s in range(C):
            xt[s] = kk[t, s] * d[s] * bt          # above the diagonal: 0 (not read by the inverse)
            pt[s] *= d[s]
        if keep:
            D[t] = d
    _invert(x, a, FLUSH if single else 0.0)


@numba.njit(nogil=True, cache=True, fastmath={"contract", "nsz"})
def chunk_systems(scores, gamma, beta, A, D):
    """``scores (M, 2C, C)`` ``[K Kᵀ; Q Kᵀ]`` a chunk, its lower half made ``P = (Q Kᵀ) ∘ D`` in
    place; ``gamma (M, C)`` float64 ``γ``; ``beta (M, C)``; ``A (M, C, C)`` out: ``(I + A)⁻¹``;
    ``D (M, C, C)`` out (the decays, zero above the diagonal), or ``(0, C, C)``: not kept.
    All C-contiguous, scores, beta, A and D of one dtype (float32 or float64)."""
    wide_vectors()
    M, C = gamma.shape
    keep, single = D.shape[0] > 0, A.itemsize == 4
    d = np.empty(C, A.dtype)
    a = np.empty(C, A.dtype)
    for m in range(M):
        _system(scores[m, :C], scores[m, C:], gamma[m], beta[m], A[m], D[m] if keep else A[m], keep, d, a, single)


@numba.njit(nogil=True, cache=True)
def pass_chunks(addr, KQ, v, beta, eg, eC, Kc, Tinv, gated, S, reads, U, starts, P, O, scale):
    """:func:`qkv.recurrent.delta.chunk_parts.pass_states` for float32, chunk after chunk with BLAS's
    ``sgemm`` called from the loop (:mod:`qkv.kernels.blas_compiled`): the same three products
    on the same operands and the same element-wise roundings in the same order (no fast-math),
    so NumPy's bits, with no Python and no temporaries between chunks. ``KQ (B,H,N,2C,Dk)``,
    ``v, reads[..., :C, :], U (B,H,N,C,Dv)``, ``beta, eg (B,H,N,C)``, ``eC (B,H,N)``,
    ``Kc (B,H,N,C,Dk)`` (KQ and Kc may have H / G heads: value head h reads head h // G), ``Tinv (B,H,N,C,C)``; ``S (B,H,Dk,Dv)`` the start state in, the final
    state out; ``starts (B,H,N,Dk,Dv)`` each chunk's start state, or of length 0 (not kept);
    ``O (B,H,N,C,Dv)``, unless of length 0, the outputs ``(P U + Qg S_0) · scale`` of
    ``P (B,H,N,C,C)``, as the forward's NumPy lines round them."""
    B, H, N, C2, Dk = v.shape[:2] + KQ.shape[2:]
    C, Dv = C2 // 2, v.shape[-1]
    gk, gc = H // KQ.shape[1], H // Kc.shape[1]                            # value heads a key head (grouped)
    N_, T_ = 78, 84
    R, X = np.empty((C, Dv), np.float32), np.empty((Dk, Dv), np.float32)
    keep = starts.shape[2] > 0
    emit = O.shape[2] > 0
    for b in range(B):
        for h in range(H):
            st = S[b, h]
            for n in range(N):
                if keep:
                    starts[b, h, n] = st
                rd = reads[b, h, n]
                gemm(addr, N_, N_, C2, Dv, Dk, KQ[b, h // gk, n], st, 0, rd)   # [K S_0; Q S_0]
                if gated:
                    for i in range(C2):
                        f = eg[b, h, n, i % C]
                        for x in range(Dv):
                            rd[i, x] *= f
                for i in range(C):                                          # beta (V - Kg S_0)
                    f = beta[b, h, n, i]
                    for x in range(Dv):
                        R[i, x] = f * (v[b, h, n, i, x] - rd[i, x])
                gemm(addr, N_, N_, C, Dv, C, Tinv[b, h, n], R, 0, U[b, h, n])  # U = Tinv R
                if emit:                                                    # O = (P U + Qg S_0) · scale
                    o = O[b, h, n]
                    gemm(addr, N_, N_, C, Dv, C, P[b, h, n], U[b, h, n], 0, o)
                    for i in range(C):
                        for x in range(Dv):
                            o[i, x] = (o[i, x] + rd[C + i, x]) * scale
                gemm(addr, T_, N_, Dk, Dv, C, Kc[b, h // gc, n], U[b, h, n], 0, X)   # Kcᵀ U
                e = eC[b, h, n]
                for d in range(Dk):                                         # S = e^{γ_C} S + Kcᵀ U
                    for x in range(Dv):
                        st[d, x] = e * st[d, x] + X[d, x]


@numba.njit(nogil=True, cache=True, fastmath={"contract", "nsz"})
def decode_step(q, k, v, beta, g, S0, has_state, l2norm, eps, scale, o, S):
    """One step of the delta rule for every ``(b, h)`` (a decoding token), in one pass over the
    state to read it and one to write the next: ``q, k (B, H, K)`` (value head h reads key head
    ``h // (HV / H)``), ``v (B, HV, V)``, ``beta (B, HV)``, ``g (B, HV, 1)`` a log decay a head or
    ``(B, HV, K)`` a key channel, ``S0 (B, HV, K, V)`` (read where ``has_state``, else zeros);
    writes ``o (B, HV, V)`` and ``S (B, HV, K, V)``. With ``l2norm`` q and k are first divided by
    ``sqrt(Σ x² + eps)``. The same equation as the step loop, with ``S' = diag(e^g) S0``::

        u = beta (v - S'ᵀk),   S = S' + k uᵀ,   o = scale · Sᵀq = scale · (S'ᵀq + u (kᵀq))

    (``o`` from ``S0`` and ``u``, so the new state is written once and never read back)."""
    B, HV, K, V = S.shape
    G = HV // q.shape[1]
    per_channel = g.shape[2] > 1
    qn, kn = np.empty(K, S.dtype), np.empty(K, S.dtype)
    ec, eq, ek = np.empty(K, S.dtype), np.empty(K, S.dtype), np.empty(K, S.dtype)
    rk, rq = np.empty(V, S.dtype), np.empty(V, S.dtype)
    for b in range(B):
        for h in range(HV):
            hk = h // G
            nq, nk = 1.0, 1.0
            if l2norm:
                sq, sk = 0.0, 0.0
                for c in range(K):
                    sq += q[b, hk, c] * q[b, hk, c]
                    sk += k[b, hk, c] * k[b, hk, c]
                nq, nk = 1.0 / math.sqrt(sq + eps), 1.0 / math.sqrt(sk + eps)
            kq = 0.0
            for c in range(K):
                qn[c], kn[c] = q[b, hk, c] * nq, k[b, hk, c] * nk
                ec[c] = math.exp(g[b, h, c if per_channel else 0])
                eq[c], ek[c] = ec[c] * qn[c], ec[c] * kn[c]
                kq += kn[c] * qn[c]
            rk[:], rq[:] = 0.0, 0.0
            if has_state:
                for c in range(K):
                    for j in range(V):
                        rk[j] += ek[c] * S0[b, h, c, j]
                        rq[j] += eq[c] * S0[b, h, c, j]
            for j in range(V):
                u = beta[b, h] * (v[b, h, j] - rk[j])
                o[b, h, j] = scale * (rq[j] + u * kq)
                rk[j] = u                                     # rk holds u from here
            if has_state:
                for c in range(K):
                    for j in range(V):
                        S[b, h, c, j] = ec[c] * S0[b, h, c, j] + kn[c] * rk[j]
            else:
                for c in range(K):
                    for j in range(V):
                        S[b, h, c, j] = kn[c] * rk[j]


_BACK_MATH = {"contract", "nsz", "reassoc"}   # the backward keeps no NumPy bits to match


@numba.njit(inline="always", fastmath=_BACK_MATH)
def _state_step(addr, K, Q, beta, eg, eC, eCg, Tinv, P, Ut, S0, dO, scale, gated, dS, Y, dU, L, Kc, dKc):
    """One chunk of the state's gradient (:mod:`.backward`): ``dS`` (at the chunk's end) made ``dS_0``; leaves
    ``Y = [scale dO; dR]``, ``L = [Qg; -Kb]``, ``Kc``, ``dKc = U dSᵀ``; returns ``e^{γ_C} Σ dS ∘ S_0`` (gated)."""
    C, Dv = dO.shape
    Dk = K.shape[1]
    for i in range(C):
        e, f, c, lq, lk, kc = eg[i], -(beta[i] * eg[i]), eCg[i], L[i], L[C + i], Kc[i]
        for d in range(Dk):
            lq[d], lk[d], kc[d] = e * Q[i, d], f * K[i, d], c * K[i, d]
        for x in range(Dv):
            Y[i, x] = scale * dO[i, x]
    gemm(addr, T_, N_, C, Dv, C, P, Y[:C], 0, dU)                  # dU = Pᵀ (scale dO)
    gemm(addr, N_, N_, C, Dv, Dk, Kc, dS, 1, dU)                    #    + Kc dS
    gemm(addr, T_, N_, C, Dv, C, Tinv, dU, 0, Y[C:])               # dR = Tinvᵀ dU
    gemm(addr, T_, T_, C, Dk, Dv, Ut, dS, 0, dKc)                   # dKc = U dSᵀ = (Uᵀ)ᵀ dSᵀ
    whole = 0.0
    if gated:
        ds, s0 = dS.reshape(Dk * Dv), S0.reshape(Dk * Dv)
        for j in range(Dk * Dv):
            whole += np.float64(ds[j]) * s0[j]
        for j in range(Dk * Dv):
            ds[j] *= eC
    gemm(addr, T_, N_, Dk, Dv, 2 * C, L, Y, 1, dS)                 # dS_0 = e^{γ_C} dS + Qgᵀ scale dO - Kbᵀ dR
    return whole * eC


@numba.njit(inline="always", fastmath=_BACK_MATH)
def _pairs(PR, D, KK, P, beta, M, pair):
    """``PR = [dP; dR Uᵀ]`` made ``[dP ∘ D; G + Gᵀ]`` in place (``G = diag(beta) dA ∘ D``,
    ``dA = -strictly_lower(dR Uᵀ)``); ``M = G ∘ KK + dP ∘ P`` (strictly lower), ``pair = Σ_s dA KK``."""
    C = D.shape[0]
    for t in range(C):
        acc = np.float32(0)
        dp, g, d, kk, p, m = PR[t], PR[C + t], D[t], KK[t], P[t], M[t]
        for s in range(t):                                           # strictly lower: row t of dR Uᵀ read, G written
            a = -g[s] * d[s]
            G = beta[t] * a
            acc += a * kk[s]
            g[s] = G
            m[s] = G * kk[s] + dp[s] * p[s]
        pair[t], g[t] = acc, 0
        for s in range(C):
            dp[s] *= d[s]                                            # dP ∘ D (0 above the diagonal)
    for t in range(C):                                               # Gᵀ above the diagonal
        for s in range(t):
            PR[C + s, t] = PR[C + t, s]


@numba.njit(inline="always", fastmath=_BACK_MATH)
def _rows(Y, RS, Z, L, dKc, Kc, KS, v, beta, eg, eCg, pair, gated, dq, dk, dv, dbeta, after, before):
    """The chunk's row-wise gradients: ``dq = e^γ dQg + Z[:C]``, ``dk = -beta e^γ (dR S_0ᵀ) +
    e^{γ_C - γ} dKc + Z[C:]``, ``dv = beta dR``, ``dbeta = Σ dR ∘ (V - Kg S_0) + pair``; gated, each row's
    decay terms ``after = Σ Qg ∘ dQg - beta Σ dR ∘ Kg S_0``, ``before = Σ dKc ∘ Kc`` (float64)."""
    C, Dk = dq.shape
    Dv = dv.shape[1]
    for i in range(C):
        e, f, c, bt = eg[i], -(beta[i] * eg[i]), eCg[i], beta[i]
        q, k, dQg, dRS, dkc, zq, zk = dq[i], dk[i], RS[i], RS[C + i], dKc[i], Z[i], Z[C + i]
        for d in range(Dk):
            q[d] = e * dQg[d] + zq[d]
            k[d] = f * dRS[d] + c * dkc[d] + zk[d]
        r, x, w, out = Y[C + i], v[i], KS[i], dv[i]
        db, kx = 0.0, 0.0
        for j in range(Dv):
            db += np.float64(r[j]) * (x[j] - w[j])
            kx += np.float64(r[j]) * w[j]
        for j in range(Dv):
            out[j] = bt * r[j]
        dbeta[i] = db + pair[i]
        if gated:
            qg, kb, lq, kc = 0.0, 0.0, L[i], Kc[i]
            for d in range(Dk):
                qg += np.float64(lq[d]) * dQg[d]
                kb += np.float64(dkc[d]) * kc[d]
            after[i], before[i] = qg - bt * kx, kb


@numba.njit(nogil=True, cache=True, fastmath={"contract", "nsz"})
def backward_states(addr, k, q, v, beta, gated, gamma, eg, eC, eCg, S, scores, D, Tinv, KS, Ut, starts):
    """The backward's pass (float32): ``k, q (B,H,N,C,Dk)``, ``v (B,H,N,C,Dv)``, ``beta, eg, eCg (B,H,N,C)``,
    ``gamma`` (float64 ``γ``: read where ``gated``), ``eC (B,H,N)``, ``S (B,H,Dk,Dv)`` the start state; out ``scores
    (B,H,N,2C,C)`` ``[K Kᵀ; P]``, ``D, Tinv (B,H,N,C,C)``, ``KS = Kg S_0``, ``Ut = Uᵀ (B,H,N,Dv,C)`` (no product
    reads U along its rows: ``blas_compiled.transpose``), ``starts (B,H,N,Dk,Dv)``."""
    wide_vectors()
    B, H, N, C, Dk = k.shape
    Dv = v.shape[-1]
    f4 = np.float32
    d, a, R, U = np.empty(C, f4), np.empty(C, f4), np.empty((C, Dv), f4), np.empty((C, Dv), f4)
    Kc, KQ, Kt = np.empty((C, Dk), f4), np.empty((2 * C, Dk), f4), np.empty((Dk, C), f4)
    for b in range(B):
        for h in range(H):
            starts[b, h, 0] = S[b, h]
            for n in range(N):
                sc, x, S0, ks, bt = scores[b, h, n], Tinv[b, h, n], starts[b, h, n], KS[b, h, n], beta[b, h, n]
                KQ[:C], KQ[C:] = k[b, h, n], q[b, h, n]
                K = KQ[:C]
                transpose(K, Kt, 0)
                gemm(addr, N_, N_, 2 * C, C, Dk, KQ, Kt, 0, sc)                 # [K; Q] Kᵀ
                _system(sc[:C], sc[C:], gamma[b, h, n], bt, x, D[b, h, n], True, d, a, True, gated)
                gemm(addr, N_, N_, C, Dv, Dk, K, S0, 0, ks)                       # K S_0
                for i in range(C):
                    f, c, vi, ki = eg[b, h, n, i], eCg[b, h, n, i], v[b, h, n, i], ks[i]
                    if gated:
                        for j in range(Dv):
                            ki[j] *= f                                           # Kg S_0
                        for j in range(Dk):
                            Kc[i, j] = c * K[i, j]
                    for j in range(Dv):
                        R[i, j] = bt[i] * (vi[j] - ki[j])                        # beta (V - Kg S_0)
                gemm(addr, N_, N_, C, Dv, C, x, R, 0, U)                          # U = Tinv R
                transpose(U, Ut[b, h, n], 0)
                end = S[b, h] if n + 1 == N else starts[b, h, n + 1]
                np.multiply(S0, eC[b, h, n], end)
                gemm(addr, T_, N_, Dk, Dv, C, Kc if gated else K, U, 1, end)      # S_C = e^{γ_C} S_0 + Kcᵀ U


@numba.njit(nogil=True, cache=True, fastmath=_BACK_MATH)
def backward_chunks(addr, k, q, v, beta, eg, eC, eCg, Tinv, scores, D, Ut, KS, starts, dO, scale, gated,
                    dS, dq, dk, dv, dbeta, dg, halves):
    """The backward's chunks backwards (float32), after :func:`backward_states` (its inputs and outputs):
    the state's gradient, then the chunk's inputs' while it is in cache. ``dO (B,H,N,C,Dv)``; ``dS (B,H,Dk,Dv)``
    the final state's gradient, out the start state's; out ``dq, dk (B,H,N,C,Dk)``, ``dv (B,H,N,C,Dv)``,
    ``dbeta, dg (B,H,N,C)`` (dg where ``gated``): the NumPy path's products, those sharing an operand stacked.
    ``halves`` (:func:`qkv.threads.small_products`): ``Y S_0ᵀ`` as two products of C rows against ``Yᵀ``, each one
    OpenBLAS's small-matrix kernels take (one thread, (1, 8, 2048, 128): 7 % less time on its SkylakeX kernels,
    3 % more on its Haswell ones, where one product against ``S_0`` read along its rows is as fast)."""
    wide_vectors()
    B, H, N, C, Dk = k.shape
    C2, Dv = 2 * C, v.shape[-1]
    f4 = np.float32
    Y, L, RS, PR, Yt = np.empty((C2, Dv), f4), np.empty((C2, Dk), f4), np.empty((C2, Dk), f4), np.empty((C2, C), f4), \
        np.empty((Dv, C2), f4)
    dU, dKc, Kc, Z = np.empty((C, Dv), f4), np.empty((C, Dk), f4), np.empty((C, Dk), f4), np.empty((C2, Dk), f4)
    M, after, before, pair = np.zeros((C, C), f4), np.zeros(C), np.zeros(C), np.empty(C, f4)
    for b in range(B):
        for h in range(H):
            for n in range(N - 1, -1, -1):
                K, Q, S0, Un, P = k[b, h, n], q[b, h, n], starts[b, h, n], Ut[b, h, n], scores[b, h, n, C:]
                whole = _state_step(addr, K, Q, beta[b, h, n], eg[b, h, n], eC[b, h, n], eCg[b, h, n], Tinv[b, h, n],
                                    P, Un, S0, dO[b, h, n], scale, gated, dS[b, h], Y, dU, L, Kc, dKc)
                if halves:                                                    # [dQg; dR S_0ᵀ] = Y S_0ᵀ
                    transpose(Y, Yt, 0)
                    gemm(addr, T_, T_, C, Dk, Dv, Yt[:, :C], S0, 0, RS[:C])
                    gemm(addr, T_, T_, C, Dk, Dv, Yt[:, C:], S0, 0, RS[C:])
                else:
                    gemm(addr, N_, T_, C2, Dk, Dv, Y, S0, 0, RS)
                gemm(addr, N_, N_, C2, C, Dv, Y, Un, 0, PR)                   # [dP; dR Uᵀ] = Y Uᵀ
                _pairs(PR, D[b, h, n], scores[b, h, n, :C], P, beta[b, h, n], M, pair)
                gemm(addr, N_, N_, C2, Dk, C, PR, K, 0, Z)                    # [(dP ∘ D) K; (G + Gᵀ) K]
                gemm(addr, T_, N_, C, Dk, C, PR[:C], Q, 1, Z[C:])             #   + [0; (dP ∘ D)ᵀ Q]
                _rows(Y, RS, Z, L, dKc, Kc, KS[b, h, n], v[b, h, n], beta[b, h, n], eg[b, h, n],
                      eCg[b, h, n], pair, gated, dq[b, h, n], dk[b, h, n], dv[b, h, n], dbeta[b, h, n], after, before)
                if gated:
                    decay_grads(after, before, whole, M, dg[b, h, n])
