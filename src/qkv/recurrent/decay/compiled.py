"""numba passes of the decay kernel (:mod:`qkv.recurrent.decay.chunk`); load it through
``qkv.jit.load(qkv.jit.DECAY)`` only.

:func:`pass_states`: the scan that passes the state from chunk to chunk,
``S_{j+1} = exp(Γ_j) ∘ S_j + U_j`` in place (``U_j`` already in ``S[:, j+1]``), one loop over
memory where NumPy takes two calls and a temporary a chunk (at T = 4096 and C = 32 that is
128 steps a head, a fifth of the forward's time). Plain arithmetic, no fast-math: each
number is rounded as NumPy's ``S[j+1] += e * S[j]`` rounds it (the product, then the sum),
so the two paths give the same bits. :func:`scaled_transpose`: the chunks' ``Kgᵀ``.
:func:`finish`: the output, ``(Q S + A V) · row`` out of the panels, one pass a slab (NumPy
took ``o += AV`` and a transposing product: at (1, 8, 4096, 128) about 14 against 5 ms).
:func:`forward_chunks` and :func:`forward_merged` (one value panel): the whole forward of float32 and a decay a
head, chunk after chunk, BLAS called from the loop (driven by :mod:`qkv.recurrent.decay.fused`; where they run,
the three passes above do not); :func:`backward_states` and :func:`backward_chunks` its backward (their own bits).
:func:`channel_scores`: with a decay a key channel, the scores' diagonal sub-blocks, their
``(c, c, Dk)`` decays made row by row in the first cache instead of stored (einsum's bits).
"""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.blas_compiled import ILP64, N_, SGEMM, T_, gemm, rows_times, transpose  # noqa: F401  (SGEMM, ILP64: decay_fused)
from ...kernels.flash.compiled import wide_vectors
from ..crossing_compiled import decay_grads
from ..delta.compiled import decay_factor


@numba.njit(cache=True)
def pass_states(S, e_gam, forward):
    """``S (n, J, p, Dk, w)``, ``e_gam (n, J-1, W)`` with W = 1 (a head) or Dk (a key row).
    ``forward``: ``S[:, j+1] += e_gam[:, j] ∘ S[:, j]`` for j = 0 … J-2; else backwards,
    ``S[:, j] += e_gam[:, j] ∘ S[:, j+1]`` for j = J-2 … 0 (the states' gradients)."""
    n, J, p, Dk, w = S.shape
    W = e_gam.shape[2]
    for h in range(n):
        for step in range(J - 1):
            j = step if forward else J - 2 - step
            src, dst = (j, j + 1) if forward else (j + 1, j)
            for a in range(p):
                for d in range(Dk):
                    e = e_gam[h, j, d if W > 1 else 0]
                    for x in range(w):
                        S[h, dst, a, d, x] += e * S[h, src, a, d, x]


@numba.njit(inline="always")
def _scaled_t(x, e, out):
    """``out (D, C) = (x ∘ e)ᵀ`` for ``x (C, D)``, ``e (C, W)`` (W = 1 or D): one product a number."""
    W = e.shape[1]
    for s in range(x.shape[0]):
        for d in range(x.shape[1]):
            out[d, s] = x[s, d] * e[s, d if W > 1 else 0]


@numba.njit(cache=True)
def scaled_transpose(k, e, out):
    """``out[h, j] = (k[h, j] ∘ e[h, j])ᵀ``: ``k (n, Nc, C, Dk)``, ``e (n, Nc, C, W)`` with W = 1
    or Dk, ``out (n, Nc, Dk, C)`` (the chunks' ``Kgᵀ``), one product a number as NumPy's
    ``np.multiply(kᵀ, eᵀ)``, in one pass over a chunk that fits the first cache where NumPy's
    strided one runs at a third of a copy's speed."""
    for h in range(k.shape[0]):
        for j in range(k.shape[1]):
            _scaled_t(k[h, j], e[h, j], out[h, j])


@numba.njit(nogil=True, cache=True)
def finish(o, av, row, scale, out, j0):
    """The forward's last pass over a slab of chunks: ``out[h, t, pp·w + x] = (o + av)[h, j, pp, c, x] · f``
    with ``t = (j0 + j)·C + c`` (rows at or past out's T dropped), ``f = row[h, j, c, 0]`` (a
    row of length 0: ``scale``). ``o, av (n, M, p, C, w)``: the state's part and the in-chunk
    part in panels; ``out (n, T, Dv)``, which ``o`` may be a view of (each number is read before
    it is written). The sum, then the product, each rounded as NumPy's ``o += av`` then
    ``o * f`` rounds it: the same bits as NumPy's path, one pass where it took two and a
    transposing copy."""
    n, M, p, C, w = o.shape
    T = out.shape[1]
    rowed = row.shape[0] > 0
    for h in range(n):
        for j in range(M):
            for c in range(C):
                t = (j0 + j) * C + c
                if t >= T:
                    break
                f = row[h, j, c, 0] if rowed else scale
                dst = out[h, t]
                for pp in range(p):
                    src, add = o[h, j, pp, c], av[h, j, pp, c]
                    for x in range(w):
                        dst[pp * w + x] = (src[x] + add[x]) * f


@numba.njit(inline="always")
def _times(a, b):
    """``a *= b``, element by element."""
    for i in range(a.shape[0]):
        for s in range(a.shape[1]):
            a[i, s] *= b[i, s]


@numba.njit(nogil=True, cache=True)
def forward_chunks(addr, q, k, v, eG, eK, row, e_gam, em_gam, mode, D, tri, S, out, scale):
    """The forward of a decay a head, float32, chunk after chunk with BLAS's ``sgemm`` between
    the passes (:mod:`qkv.kernels.blas_compiled`): what :func:`qkv.recurrent.decay.chunk._forward_unit`
    computes, the same products and the same roundings in the same order, each chunk's arrays
    made and used while they are in cache, where the NumPy path makes each for every chunk of
    a segment before the next step reads them back from memory.

    ``q, k (n, Nc, C, Dk)``, ``v (n, Nc, C, Dv)``; ``eG, eK, row (n, Nc, C, 1)``: ``exp(G)``,
    ``exp(Γ - G)`` and ``exp(G) · scale``; ``e_gam (n, Nc, 1)`` ``exp(Γ)``; ``em_gam (n, Nc)``
    ``exp(-Γ)``; ``mode (n, Nc)``: 1 where the head's chunk takes the rank-one factors
    (``A = tril(q Kgᵀ) · exp(-Γ)``, rows times ``row``), 0 where it takes the mask ``D (n, Nc, C, C)``
    (``A = (q kᵀ) ∘ D``, the state's part times ``exp(G)``, rows times ``scale``); ``tri (C, C)``
    the lower triangle's ones; ``S (n, p, Dk, w)`` the state entering the first chunk in ``p``
    panels of ``w`` columns, the state after the last on return; ``out (n, T, Dv)``."""
    n, Nc, C, Dk = q.shape
    p, w = S.shape[1], S.shape[3]
    T = out.shape[1]
    kt = np.empty((Dk, C), np.float32)
    A = np.empty((C, C), np.float32)
    qs = np.empty((p, C, w), np.float32)
    av = np.empty((p, C, w), np.float32)
    spare = np.empty((p, Dk, w), np.float32)
    for h in range(n):
        cur, nxt = S[h], spare                                          # the state in and the one made, in turn
        for j in range(Nc):
            qj, kj, vj = q[h, j], k[h, j], v[h, j]
            for a in range(p):                                          # Q S
                gemm(addr, N_, N_, C, w, Dk, qj, cur[a], 0, qs[a])
            _scaled_t(kj, eK[h, j], kt)                                 # Kgᵀ
            factored = mode[h, j] != 0
            if factored:                                                # tril(q Kgᵀ) · exp(-Γ)
                gemm(addr, N_, N_, C, C, Dk, qj, kt, 0, A)
                e = em_gam[h, j]
                for i in range(C):
                    for s in range(C):
                        A[i, s] = (A[i, s] * tri[i, s]) * e
            else:                                                       # (q kᵀ) ∘ D; the state's part times exp(G)
                gemm(addr, N_, T_, C, C, Dk, qj, kj, 0, A)
                _times(A, D[h, j])
                for a in range(p):
                    for i in range(C):
                        f = eG[h, j, i, 0]
                        for x in range(w):
                            qs[a, i, x] *= f
            for a in range(p):                                          # A V
                gemm(addr, N_, N_, C, w, C, A, vj[:, a * w:(a + 1) * w], 0, av[a])
            for i in range(min(C, T - j * C)):                          # (Q S + A V) · row
                f = row[h, j, i, 0] if factored else scale
                dst = out[h, j * C + i]
                for a in range(p):
                    for x in range(w):
                        dst[a * w + x] = (qs[a, i, x] + av[a, i, x]) * f
            e = e_gam[h, j, 0]
            for a in range(p):                                          # S' = exp(Γ) ∘ S + Kgᵀ V
                gemm(addr, N_, N_, Dk, w, C, kt, vj[:, a * w:(a + 1) * w], 0, nxt[a])
                for d in range(Dk):
                    for x in range(w):
                        nxt[a, d, x] += e * cur[a, d, x]
            cur, nxt = nxt, cur
        if Nc % 2:
            S[h] = cur


@numba.njit(nogil=True, cache=True)
def forward_merged(addr, q, k, v, eG, eK, row, e_gam, em_gam, mode, D, tri, S, out, scale):
    """:func:`forward_chunks` for values in one panel (``S (n, 1, Dk, Dv)``) in two products a
    chunk where that makes four: products that share an operand are made as one, on the
    operands side by side in one buffer ``W = [·, A; S, Kgᵀ]`` ``(C + Dk, Dv + C)``::

        [Q S | Q Kgᵀ]     = Q [S | Kgᵀ]              (C, Dk) @ (Dk, Dv + C)
        [A V ; Kgᵀ V]     = [A ; Kgᵀ] V              (C + Dk, C) @ (C, Dv)

    One call packs ``Q`` and ``V`` once where two did each, with larger products. The same
    dot products, each a sum in the same order of k; OpenBLAS's AVX-512 kernels round them as
    the four products do (NumPy's bits, tested), its Haswell kernels do not always (within
    float32's rounding of them; tested). The state's update is made in place,
    ``S = Kgᵀ V + exp(Γ) ∘ S`` (the sum as NumPy's ``U += exp(Γ) ∘ S``)."""
    n, Nc, C, Dk = q.shape
    Dv = S.shape[3]
    T = out.shape[1]
    W = np.zeros((C + Dk, Dv + C), np.float32)
    O2 = np.empty((C, Dv + C), np.float32)                             # [Q S | Q Kgᵀ]
    O1 = np.empty((C + Dk, Dv), np.float32)                            # [A V ; Kgᵀ V]
    St, kt, A = W[C:, :Dv], W[C:, Dv:], W[:C, Dv:]
    for h in range(n):
        St[:] = S[h, 0]
        for j in range(Nc):
            qj, kj, vj = q[h, j], k[h, j], v[h, j]
            _scaled_t(kj, eK[h, j], kt)                                 # Kgᵀ
            factored = mode[h, j] != 0
            if factored:                                                # tril(q Kgᵀ) · exp(-Γ)
                gemm(addr, N_, N_, C, Dv + C, Dk, qj, W[C:], 0, O2)
                e = em_gam[h, j]
                for i in range(C):
                    for s in range(C):
                        A[i, s] = (O2[i, Dv + s] * tri[i, s]) * e
            else:                                                       # (q kᵀ) ∘ D; the state's part times exp(G)
                gemm(addr, N_, N_, C, Dv, Dk, qj, St, 0, O2[:, :Dv])
                gemm(addr, N_, T_, C, C, Dk, qj, kj, 0, A)
                _times(A, D[h, j])
                for i in range(C):
                    f = eG[h, j, i, 0]
                    for x in range(Dv):
                        O2[i, x] *= f
            gemm(addr, N_, N_, C + Dk, Dv, C, W[:, Dv:], vj, 0, O1)
            for i in range(min(C, T - j * C)):                          # (Q S + A V) · row
                f = row[h, j, i, 0] if factored else scale
                dst = out[h, j * C + i]
                for x in range(Dv):
                    dst[x] = (O2[i, x] + O1[i, x]) * f
            e = e_gam[h, j, 0]
            for d in range(Dk):                                         # S' = exp(Γ) ∘ S + Kgᵀ V
                for x in range(Dv):
                    St[d, x] = O1[C + d, x] + e * St[d, x]
        S[h, 0] = St


@numba.njit(nogil=True, cache=True)
def channel_scores(q, k, a, A, sub):
    """The diagonal sub-blocks of the scores with a decay a key channel, without their
    ``(c, c, Dk)`` factor: for the rows i of each block ``[r0, r1)`` of ``sub`` rows and
    ``r0 <= s <= i``, ``A[h, j, i, s] = Σ_d q_id k_sd E_isd`` with ``E_isd = Π_{s < t <= i} a_td``
    made row by row as :func:`qkv.recurrent.decay.intra._products` makes it
    (``E_is = E_{i-1,s} a_i``, ``E_ii = 1``), kept for one block in the first cache.
    ``q, k, a (n, M, C, Dk)``, ``A (n, M, C, C)`` (the rest of A untouched). Each term is
    ``(q k) E`` and the sum over d runs in order, as NumPy's three-operand ``einsum`` makes
    them: its bits (tested)."""
    n, M, C, Dk = q.shape
    kt = np.empty((Dk, sub), A.dtype)                 # the block's keys, transposed: s contiguous
    et = np.empty((Dk, sub), A.dtype)                 # E_i·d for the block's columns s <= i
    acc = np.empty(sub, A.dtype)
    for h in range(n):
        for j in range(M):
            for r0 in range(0, C, sub):
                c = min(sub, C - r0)
                for s in range(c):
                    for d in range(Dk):
                        kt[d, s] = k[h, j, r0 + s, d]
                for x in range(c):                    # row i = r0 + x
                    for d in range(Dk):
                        ad = a[h, j, r0 + x, d]
                        for s in range(x):
                            et[d, s] *= ad
                        et[d, x] = 1
                    acc[:x + 1] = 0
                    for d in range(Dk):
                        qd = q[h, j, r0 + x, d]
                        for s in range(x + 1):
                            acc[s] += qd * kt[d, s] * et[d, s]
                    for s in range(x + 1):
                        A[h, j, r0 + x, r0 + s] = acc[s]


@numba.njit(nogil=True, cache=True)
def channel_factors(a, r0, eq, ek):
    """A decay a key channel, the factors of a sub-block (rows ``r0 …``) below the diagonal,
    about row ``r = r0 - 1``: ``eq[.., x, :] = Π_{r < j <= r0 + x} a_j`` and
    ``ek[.., s, :] = Π_{s < j <= r} a_j`` (``ek[.., r, :] = 1``), each a running product as
    NumPy's ``cumprod`` makes it (the same bits). ``a (n, M, C, Dk)``, ``eq (n, M, c, Dk)``,
    ``ek (n, M, r0, Dk)``."""
    n, M, c, Dk = eq.shape
    for h in range(n):
        for j in range(M):
            for d in range(Dk):
                eq[h, j, 0, d] = a[h, j, r0, d]
            for x in range(1, c):
                for d in range(Dk):
                    eq[h, j, x, d] = eq[h, j, x - 1, d] * a[h, j, r0 + x, d]
            for d in range(Dk):
                ek[h, j, r0 - 1, d] = 1
            for s in range(r0 - 2, -1, -1):
                for d in range(Dk):
                    ek[h, j, s, d] = ek[h, j, s + 1, d] * a[h, j, s + 1, d]


_BACK = {"contract", "nsz", "reassoc"}   # the float32 backward keeps no NumPy bits to match


@numba.njit(nogil=True, cache=True, fastmath=_BACK)
def backward_states(addr, k, v, eK, e_gam, S0, starts):
    """The backward's first sweep (float32, a decay a head), chunks forwards: ``starts[h, j] = [S_jᵀ | V_jᵀ]``
    ``(n, Nc, Dv, Dk + C)``, the state entering chunk j beside its values, both transposed (so no product of the
    backward reads an operand along its rows), ``S_{j+1}ᵀ = exp(Γ_j) S_jᵀ + V_jᵀ Kg_j`` from ``S0 (n, Dk, Dv)``.
    ``k (n, Nc, C, Dk)``, ``v (n, Nc, C, Dv)``, ``eK (n, Nc, C)``, ``e_gam (n, Nc)``."""
    wide_vectors()
    n, Nc, C, Dk = k.shape
    Dv = v.shape[3]
    Kg = np.empty((C, Dk), np.float32)
    for h in range(n):
        transpose(S0[h], starts[h, 0], 0)
        for j in range(Nc):
            st = starts[h, j]
            transpose(v[h, j], st, Dk)
            if j + 1 < Nc:
                rows_times(k[h, j], eK[h, j], Kg)
                out, nxt, e = starts[h, j + 1, :, :Dk], starts[h, j + 1], e_gam[h, j]
                for x in range(Dv):
                    for d in range(Dk):
                        nxt[x, d] = e * st[x, d]
                gemm(addr, T_, N_, Dv, Dk, C, v[h, j], Kg, 1, out)             # S_{j+1}ᵀ = exp(Γ) S_jᵀ + Vᵀ Kg


@numba.njit(inline="always", fastmath=_BACK)
def _masks(QK, G, D, L, Dk):
    """``D = exp(G_t - G_s)`` on and below the diagonal (0 above); ``QK`` made ``A = QK ∘ D``, ``L[Dk + t] = A_t``."""
    C = G.shape[0]
    for t in range(C):
        for s in range(t + 1):
            D[t, s] = decay_factor(min(G[t] - G[s], 0.0), True)
        for s in range(t + 1, C):
            D[t, s] = 0
        for s in range(C):
            QK[t, s] *= D[t, s]
            L[Dk + t, s] = QK[t, s]


@numba.njit(inline="always", fastmath=_BACK)
def _grad_rows(R, dKg, Qg, K, A, D, eG, eK, dq, dk, P, M, after, before):
    """``dq = e^G ∘ dQg``, ``dk = e^{Γ-G} ∘ dKg`` (the in-chunk parts added after), ``P = dA ∘ D``,
    ``M = dA ∘ A``; each row's decay terms ``after = Σ dQg ∘ Qg``, ``before = Σ dKg ∘ Kg = e^{Γ-G} Σ dKg ∘ K``."""
    C, Dk = dq.shape
    for i in range(C):
        e, f, aq, bk = eG[i], eK[i], np.float32(0), np.float32(0)
        for d in range(Dk):
            x, y = R[i, d], dKg[i, d]
            aq += x * Qg[i, d]
            bk += y * K[i, d]
            dq[i, d] = e * x
            dk[i, d] = f * y
        after[i], before[i] = aq, f * bk
        for s in range(C):
            dA = R[i, Dk + s]
            P[i, s] = dA * D[i, s]
            M[i, s] = dA * A[i, s]


@numba.njit(nogil=True, cache=True, fastmath=_BACK)
def backward_chunks(addr, q, k, v, dO, G, eG, eK, e_gam, starts, scale, dS, dq, dk, dv, dg):
    """The backward's chunks backwards (float32, a decay a head), each chunk's gradients while its blocks are in
    cache, products sharing an operand stacked. ``q, k, dq, dk (n, Nc, C, Dk)``, ``v, dO, dv (n, Nc, C, Dv)``, ``G``
    (float64), ``eG, eK, dg (n, Nc, C)``, ``e_gam (n, Nc)``, ``starts`` from :func:`backward_states`; ``dS (n, Dk,
    Dv)`` the final state's gradient, the initial's on return. The derivation: :mod:`.chunk`'s docstring. ``Z = [dS'ᵀ |
    dO'ᵀ]``, ``L = [Kgᵀ; A]``: no product reads an operand along its rows (``blas_compiled.transpose``)."""
    wide_vectors()
    n, Nc, C, Dk = q.shape
    Dv = v.shape[3]
    Z, L, R = np.empty((Dv, Dk + C), np.float32), np.empty((Dk + C, C), np.float32), np.empty((C, Dk + C), np.float32)
    A, D, P, M = np.zeros((C, C), np.float32), np.zeros((C, C), np.float32), np.zeros((C, C), np.float32), np.zeros((C, C), np.float32)
    Qg, dKg, Kt = np.empty((C, Dk), np.float32), np.empty((C, Dk), np.float32), np.empty((Dk, C), np.float32)
    after, before = np.zeros(C), np.zeros(C)
    for h in range(n):
        transpose(dS[h], Z, 0)                                       # Z = [dS'ᵀ | dO'ᵀ]
        for j in range(Nc - 1, -1, -1):
            Q, K, V, st, dST, dOT, ek, dOj = q[h, j], k[h, j], v[h, j], starts[h, j], Z[:, :Dk], Z[:, Dk:], eK[h, j], dO[h, j]
            for x in range(Dv):                                            # (Z, not its views: a known stride vectorizes)
                for i in range(C):
                    Z[x, Dk + i] = scale * dOj[i, x]
            rows_times(Q, eG[h, j], Qg)
            for d in range(Dk):                                            # Kᵀ, and L = [Kgᵀ; A]
                for i in range(C):
                    Kt[d, i] = K[i, d]
                    L[d, i] = Kt[d, i] * ek[i]
            gemm(addr, N_, N_, C, C, Dk, Q, Kt, 0, A)                     # Q Kᵀ
            _masks(A, G[h, j], D, L, Dk)
            gemm(addr, T_, T_, C, Dv, Dk + C, L, Z, 0, dv[h, j])          # dv = Kg dS' + Aᵀ dO'
            gemm(addr, T_, N_, C, Dk + C, Dv, dOT, st, 0, R)              # [dQg | dA] = dO' [Sᵀ | Vᵀ]
            gemm(addr, N_, N_, C, Dk, Dv, V, dST, 0, dKg)                 # dKg = V dS'ᵀ
            whole, e = 0.0, e_gam[h, j]
            for x in range(Dv):
                part = np.float32(0)
                for d in range(Dk):
                    part += Z[x, d] * st[x, d]
                    Z[x, d] *= e
                whole += part
            gemm(addr, N_, N_, Dv, Dk, C, dOT, Qg, 1, dST)                # dSᵀ = exp(Γ) dS'ᵀ + dO'ᵀ Qg
            _grad_rows(R, dKg, Qg, K, A, D, eG[h, j], ek, dq[h, j], dk[h, j], P, M, after, before)
            gemm(addr, N_, N_, C, Dk, C, P, K, 1, dq[h, j])               # dq += (dA ∘ D) K
            gemm(addr, T_, N_, C, Dk, C, P, Q, 1, dk[h, j])               # dk += (dA ∘ D)ᵀ Q
            decay_grads(after, before, whole * e, M, dg[h, j])
        transpose(Z[:, :Dk], dS[h], 0)
