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
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, SGEMM, gemm  # noqa: F401  (SGEMM, ILP64: read by delta_chunks)
from ...kernels.flash.compiled import COEF, wide_vectors

_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (np.float32(c) for c in COEF)
_LOG2E = 1.4426950408889634
FLUSH = 2.0 ** -60  # float32: a decay, an entry of A or of (I + A)⁻¹ below it is 0 (module docstring);
                    # decay_intra.FLUSH, the NumPy side's, is the same (a test holds them equal)


@numba.njit(inline="always", fastmath={"contract", "nsz"})
def _decay(x, single):
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
        kk, qk, x, gam = scores[m, :C], scores[m, C:], A[m], gamma[m]
        for t in range(C):
            for s in range(t + 1):
                d[s] = _decay(gam[t] - gam[s], single)
            for s in range(t + 1, C):
                d[s] = 0
            bt, xt, pt = beta[m, t], x[t], qk[t]
            for s in range(C):
                xt[s] = kk[t, s] * d[s] * bt      # above the diagonal: 0 (not read by the inverse)
                pt[s] *= d[s]
            if keep:
                D[m, t] = d
        _invert(x, a, FLUSH if single else 0.0)


@numba.njit(nogil=True, cache=True)
def pass_chunks(addr, KQ, v, beta, eg, eC, Kc, Tinv, gated, S, reads, U, starts, P, O, scale):
    """:func:`qkv.recurrent.delta.chunk_parts.pass_states` for float32, chunk after chunk with BLAS's
    ``sgemm`` called from the loop (:mod:`qkv.kernels.blas_compiled`): the same three products
    on the same operands and the same element-wise roundings in the same order (no fast-math),
    so NumPy's bits, with no Python and no temporaries between chunks. ``KQ (B,H,N,2C,Dk)``,
    ``v, reads[..., :C, :], U (B,H,N,C,Dv)``, ``beta, eg (B,H,N,C)``, ``eC (B,H,N)``,
    ``Kc (B,H,N,C,Dk)``, ``Tinv (B,H,N,C,C)``; ``S (B,H,Dk,Dv)`` the start state in, the final
    state out; ``starts (B,H,N,Dk,Dv)`` each chunk's start state, or of length 0 (not kept);
    ``O (B,H,N,C,Dv)``, unless of length 0, the outputs ``(P U + Qg S_0) · scale`` of
    ``P (B,H,N,C,C)``, as the forward's NumPy lines round them."""
    B, H, N, C2, Dk = KQ.shape
    C, Dv = C2 // 2, v.shape[-1]
    N_, T_ = 78, 84
    R = np.empty((C, Dv), np.float32)
    X = np.empty((Dk, Dv), np.float32)
    keep = starts.shape[2] > 0
    emit = O.shape[2] > 0
    for b in range(B):
        for h in range(H):
            st = S[b, h]
            for n in range(N):
                if keep:
                    starts[b, h, n] = st
                rd = reads[b, h, n]
                gemm(addr, N_, N_, C2, Dv, Dk, KQ[b, h, n], st, 0, rd)        # [K S_0; Q S_0]
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
                gemm(addr, T_, N_, Dk, Dv, C, Kc[b, h, n], U[b, h, n], 0, X)   # Kcᵀ U
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
