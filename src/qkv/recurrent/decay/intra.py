"""The decayed products inside the chunks of :mod:`qkv.recurrent.decay.chunk`.

Inside a chunk of C positions, with ``G_i`` the cumulative log decay from the chunk's start
(``G_i = g_1 + ... + g_i``, kept in float64: see below), three products carry the decays
``exp(G_i - G_s)`` between a later row i and an earlier row s (``s <= i``)::

    scores   A_is = Σ_d q_id k_sd exp(G_id - G_sd)                (C, C), lower triangle
    rows     X_i  = Σ_{s <= i} P_is (k_s ∘ exp(G_i - G_s))         (C, Dk)  (dq's in-chunk part)
    cols     Y_s  = Σ_{i >= s} P_is (q_i ∘ exp(G_i - G_s))         (C, Dk)  (dk's in-chunk part)

**One decay a head** (``G`` of width 1): ``D_is = exp(G_i - G_s)`` for ``s <= i`` and 0
above the diagonal is one ``(C, C)`` factor, and the three are matrix products:
``A = (Q Kᵀ) ∘ D``, ``X = (P ∘ D) K``, ``Y = (P ∘ D)ᵀ Q``. ``G_i - G_s <= 0`` is taken with
``i >= s`` only (``-inf`` above the diagonal), so D is in [0, 1]: nothing overflows, a
decay that underflows is one whose true value is below the smallest float. Where a
chunk decays by at most ``exp(-20)`` (``Γ = G_C >= -LIMIT``, the common case) its D is the
lower triangle of a rank-one matrix, ``exp(G_i - Γ) · exp(Γ - G_s)``, the first factor in
``[1, e^20]``, the second in ``[e^-20, 1]``: they are folded into Q and K and no ``(C, C)``
exp is taken. The choice is made a chunk of a head: a slab mixing such chunks with steeper
ones (Mamba-2's few heads of large ``A dt``) gathers each kind, takes its products and puts
them back, so only the steep chunks pay for the exp (a slab of one kind as it was). The
scores reuse the chunked form's own ``Qg = Q ∘ exp(G)`` and ``Kg = K ∘ exp(Γ - G)``:
``A = tril(Qg Kgᵀ) · exp(-Γ)`` (their product's upper triangle is at most ``|q_i · k_s|``,
so the mask's 0 never meets an inf); the backward's rows and cols take ``tril(P)`` between
``u = exp(G - Γ)`` and ``w = exp(Γ - G)``.

**A decay a key channel** (``G`` of width Dk): the factor differs per channel and cannot be
pulled out of the sum over d. Splitting ``exp(G_i - G_s) = exp(G_i) exp(-G_s)`` would make
one factor overflow (``exp(30·C)`` for decays of ``exp(-30)`` a step). So the chunk is cut
into sub-blocks of c rows (:data:`SUB`), and a pair of them is handled by where it lies:

* below the diagonal (rows of sub-block I, columns of an earlier J): factor about the last
  row ``r`` before I, with ``s <= r < i``::

      exp(G_i - G_s) = exp(G_i - G_r) · exp(G_r - G_s),     both factors in [0, 1]

  so ``A[I, <I] = (Q_I ∘ exp(G_I - G_r)) (K_<I ∘ exp(G_r - G_<I))ᵀ`` is one matrix product;
  rows and cols factor the same way.
* on the diagonal: the ``(c, c, Dk)`` block of ``exp(G_i - G_s)`` itself, contracted over
  d element by element (``einsum``), 0 above the diagonal.

Both kinds of factor are products of the step decays ``a_j = exp(g_j)`` in [0, 1]:
``exp(G_i - G_s) = Π_{s < j <= i} a_j``, made by running products (a diagonal block row
by row from the one above it, ``E_is = E_{i-1,s} a_i``; the factors about r by ``cumprod``
forwards and backwards from r). Multiplications only, no exp beyond ``a`` itself: each
factor is rounded like the step recurrence's own running product (a relative error of at
most about ``C·eps``), and a product of numbers in [0, 1] can only underflow to 0.

Cost a row and key channel: about ``c/2`` multiplications for the diagonal block, ``2c``
for each contraction with it, and ``C/(2c)`` for the factors below it; c = :data:`SUB`.

**Precision of the one-a-head factor.** ``G`` is a cumulative sum and differences of it lose
digits in proportion to its size (``|G|`` up to ``30·C``); the sums and differences are taken
in float64 and rounded to the compute dtype only as the argument of the exp, so each decay
factor is within an ulp or two of ``exp`` of the exact difference.
"""
from __future__ import annotations

import threading
from functools import cached_property

import numpy as np

from ... import jit
from .. import crossing
from ...kernels.flash.tiles import DEFAULT, scratch

SUB = 16      # rows of a diagonal sub-block (decay a key channel)
LIMIT = 20.0  # a head's chunks decaying by at most exp(-LIMIT) take the rank-one factors
FLUSH = 2.0 ** -60  # float32: a decay factor below is 0 (see decayed(); delta_compiled.FLUSH is the same)
FLUSH_LOG = -60 * 0.6931471805599453  # log(FLUSH)


def _t(x):
    return np.swapaxes(x, -1, -2)


def factors(x64: np.ndarray, dtype) -> np.ndarray:
    """:func:`decayed`, computed in float64 and rounded once: for the rank-one factors of one
    decay a head (``G``, ``Γ - G``, ``Γ``, each of width 1), whose products cancel large
    exponents (``e^{G_i} · e^{Γ - G_s} · e^{-Γ} = e^{G_i - G_s}``). An argument rounded to
    float32 first errs by ``|x|·eps/2`` in its exponent: ``10 eps`` at ``|x| = 20``, which the
    product keeps relative to a factor near 1 (a Mamba-2 output erred 3.4x transformers' float32
    path). A ``(C, C)`` factor ``exp(G_i - G_s)`` needs no such care: its error ``|x| e^x eps/2``
    stays below ``eps/5`` whatever ``x``."""
    e = np.exp(x64).astype(dtype, copy=False)
    if e.dtype == np.float32:
        e[x64 < FLUSH_LOG] = 0
    return e


def decayed(x64: np.ndarray, dtype) -> np.ndarray:
    """``exp`` of a float64 log decay (``<= 0``) in the compute dtype; in float32 a factor below
    ``2^-60`` (:data:`FLUSH_LOG`) is 0. Such a factor is ``2^-36`` below float32's resolution
    of any sum it enters beside an undecayed term, and the product of two of them stays out of
    float32's subnormal range, where Intel's cores take a microcode assist an operation (with
    steps of about -20 a step the forward took 3.3x the time of mild decays, as AVX2)."""
    x = x64.astype(dtype, copy=False)
    if x.dtype == np.float32:                                           # a fresh array: astype copied
        x[x < FLUSH_LOG] = -np.inf
        return np.exp(x, out=x)
    return np.exp(x)


def cumulative(g: np.ndarray, floor: float) -> np.ndarray:
    """``G = cumsum(max(g, floor))`` over each chunk's rows (axis 2) in float64, ``g (n, Nc, C, W)``:
    compiled where the ``fast`` extra is (:func:`qkv.recurrent.decay.intra_compiled.chunk_cumsum`, the same bits)."""
    mod = jit.load(jit.DECAY_INTRA) if g.dtype in (np.float32, np.float64) else None
    if mod is None:
        return np.cumsum(np.maximum(g.astype(np.float64), floor), axis=2)
    G = np.empty(g.shape, np.float64)
    mod.chunk_cumsum(g, floor, G)
    return G


def _lower(G: np.ndarray, dtype) -> np.ndarray:
    """``D = exp(G_i - G_s)`` where ``s <= i`` and 0 above the diagonal: ``G (n, M, C, 1)`` float64 -> ``(n, M,
    C, C)`` in the compute dtype, in a per-thread work array that the next call overwrites (made afresh, a
    slab's temporaries cost page faults: 2 heads × 32 chunks of 64, one thread, 6.2 against 0.97 ms in a
    process whose allocator has not yet kept freed memory). Each number rounded as :func:`decayed` rounds
    it: the float64 difference (``-inf`` above the diagonal), then its exp in the compute dtype (float32: 0
    below :data:`FLUSH`). The float32 argument in one compiled pass where the ``fast`` extra is (the same
    bits: :func:`qkv.recurrent.decay.intra_compiled.lower_mask`; that slab, this Xeon: 1.3 against 0.3 ms)."""
    n, M, C = G.shape[:3]
    size, dt = n * M * C * C, np.dtype(dtype)
    _made.__dict__.setdefault("box", [0])[0] += 1                       # a D made before this one is gone
    D = scratch(size, dt, DEFAULT, "decay_D").reshape(n, M, C, C)
    if dt == np.float32 and G.dtype == np.float64 and (mod := jit.load(jit.DECAY_INTRA)) is not None:
        mod.lower_mask(G, D, np.float32(FLUSH_LOG))
        return np.exp(D, out=D)
    diff = scratch(size, np.float64, DEFAULT, "decay_diff").reshape(n, M, C, C)
    np.subtract(G, _t(G), out=diff)                                     # (n,M,C,1) - (n,M,1,C): G_i - G_s
    np.copyto(diff, -np.inf, where=~np.tri(C, dtype=bool))
    if dt == np.float32:
        np.copyto(D, diff)                                              # rounded as astype rounds
        np.copyto(D, -np.inf, where=D < FLUSH_LOG)
        return np.exp(D, out=D)
    return np.exp(diff.astype(dt, copy=False), out=D)


_made = threading.local()   # box: [how many masks this thread's work arrays have held] (HeadDecay.D checks)


class HeadDecay:
    """One decay a head, on a slab of chunks: the ``(C, C)`` factor ``D`` ``(n, M, C, C)``, or,
    where every chunk of the slab decays by at most ``exp(-LIMIT)`` (:data:`LIMIT`), its two
    rank-one factors ``u = exp(G - Γ)`` and ``w = exp(Γ - G)`` ``(n, M, C, 1)`` (Γ the
    chunk's last G): ``D = tril(u wᵀ)``, folded into the products. A slab of both kinds
    (``steep (n, M)`` the chunks past the limit, else None) holds one of each for its chunks
    of that kind, gathered: ``parts``, the factored one first. ``D`` lives in a work array
    until the thread's next mask (:func:`_lower`): a slab's products, then the next slab's."""

    def __init__(self, G: np.ndarray, dtype):
        mild = G[:, :, -1, 0] >= -LIMIT                                  # (n,M): the chunks that factor
        self.factored = bool(mild.all())
        self.steep = ~mild if mild.any() and not self.factored else None
        self._G, self._dtype = G, dtype
        if self.factored:
            self.e_gam = factors(-G[:, :, -1:], dtype)                  # exp(-Γ) (n,M,1,1)
        elif self.steep is not None:
            self.parts = (HeadDecay(G[mild][None], dtype), HeadDecay(G[self.steep][None], dtype))
        else:
            self._D = _lower(G, dtype)                                  # (n,M,C,C)
            self._box, self._made = _made.box, _made.box[0]             # the making thread's count

    @property
    def D(self) -> np.ndarray:
        """The ``(C, C)`` mask while the thread's work array holds it: else an error, never another slab's."""
        if self._made != self._box[0]:
            raise RuntimeError("qkv internal: a HeadDecay's D was read after the thread made another "
                               "slab's mask in its work array (read or copy D before the next HeadDecay)")
        return self._D

    def chunks(self, e_gam, D) -> np.ndarray:
        """Each chunk's kind, ``(n, M)`` True where it factors: ``e_gam (n, M)`` given its
        ``exp(-Γ)`` there, ``D (n, M, C, C)`` its mask elsewhere (the rest left as they are)."""
        if self.steep is not None:
            factored, steep = self.parts
            e_gam[~self.steep], D[self.steep] = factored.e_gam[0, :, 0, 0], steep.D[0]
            return ~self.steep
        if self.factored:
            e_gam[:] = self.e_gam[:, :, 0, 0]
        else:
            D[:] = self.D
        return np.full(e_gam.shape, self.factored)

    def _gathered(self, name: str, out, *xs):
        """A mixed slab: ``out[sel] = parts' name(x[sel] for x in xs)`` for each kind's chunks."""
        for part, sel in zip(self.parts, (~self.steep, self.steep)):
            out[sel] = getattr(part, name)(*(x[sel][None] for x in xs))[0]
        return out

    @cached_property
    def u(self):                                                        # exp(G - Γ), in [1, e^LIMIT]
        return factors(self._G - self._G[:, :, -1:], self._dtype)

    @cached_property
    def w(self):                                                        # exp(Γ - G), in [e^-LIMIT, 1]
        return factors(self._G[:, :, -1:] - self._G, self._dtype)

    @cached_property
    def upper(self):
        return ~np.tri(self._G.shape[2], dtype=bool)

    def _masked(self, P):
        """``P ∘ D`` (factored: ``tril(P)``, the rank-one factors applied by the caller)."""
        if not self.factored:
            return P * self.D
        P = P.copy()
        np.copyto(P, 0, where=self.upper)
        return P

    def scores(self, q, k, Qg, KgT):
        """``A`` from q and k, or, factored, from the chunk's ``Qg = q ∘ exp(G)`` and
        ``KgT = (k ∘ exp(Γ - G))ᵀ`` ``(n, M, Dk, C)``:
        ``Qg_i · Kg_s = (q_i · k_s) exp(G_i - G_s) exp(Γ)``, so
        ``A = tril(Qg Kgᵀ) · exp(-Γ)``. Above the diagonal ``G_i - G_s <= -Γ``, so those
        entries are at most ``|q_i · k_s|``: the mask's 0 multiplies nothing infinite."""
        if self.factored:
            return self.scores_unrowed(Qg, KgT)                         # Qg's rows carry exp(G_i)
        if self.steep is not None:
            return self._scores_mixed(Qg, q, k, KgT)
        n, M, C = q.shape[:3]
        A = scratch(n * M * C * C, q.dtype, DEFAULT, "decay_A").reshape(n, M, C, C)
        np.matmul(q, _t(k), out=A)                                      # (n,M,C,Dk) @ (n,M,Dk,C) -> (n,M,C,C)
        A *= self.D
        return A

    def _scores_mixed(self, x, q, k, KgT):
        """A mixed slab's scores: the factored chunks' ``scores_unrowed(x, KgT)``, the others' whole."""
        (n, M, C), steep = q.shape[:3], self.steep
        A = scratch(n * M * C * C, q.dtype, DEFAULT, "decay_A_mixed").reshape(n, M, C, C)
        A[~steep] = self.parts[0].scores_unrowed(x[~steep][None], KgT[~steep][None])[0]
        A[steep] = self.parts[1].scores(q[steep][None], k[steep][None], None, None)[0]
        return A

    def forward_scores(self, q, k, KgT, o, row, eG, scale):
        """The forward's scores: a factored chunk's without its rows' ``exp(G_i)``
        (:meth:`scores_unrowed`: the finished output rows take ``row = exp(G_i) · scale``), the
        others' whole, their state's part ``o (n, M, p, C, w)`` times ``eG = exp(G) (n, M, C, 1)``
        now and their ``row`` the scale."""
        if self.factored:
            return self.scores_unrowed(q, KgT)
        if self.steep is None:
            o *= eG[:, :, None]
            row[:] = scale
            return self.scores(q, k, None, None)
        o[self.steep] *= eG[self.steep][:, None]                         # (K,p,C,w) *= (K,1,C,1)
        row[self.steep] = scale
        return self._scores_mixed(q, q, k, KgT)

    def scores_unrowed(self, q, KgT):
        """Factored only: the forward's ``A`` without its rows' ``exp(G_i)``,
        ``tril(q Kgᵀ) · exp(-Γ)`` (entries ``(q_i · k_s) exp(-G_s)``, at most
        ``e^LIMIT |q_i · k_s|``): the forward multiplies whole output rows by ``exp(G_i)``
        once, after both products, instead of making ``Qg``. (Given ``Qg`` for q, the whole
        ``A``: :meth:`scores`'s factored form.)"""
        n, M, C = q.shape[:3]
        A = scratch(n * M * C * C, q.dtype, DEFAULT, "decay_A").reshape(n, M, C, C)
        np.matmul(q, KgT, out=A)                                        # (n,M,C,Dk) @ (n,M,Dk,C) -> (n,M,C,C)
        A *= np.tri(C, dtype=q.dtype)
        A *= self.e_gam                                                 # exp(-Γ) (n,M,1,1), at most e^LIMIT
        return A

    def rows(self, P, k):                                               # (n,M,C,C) @ (n,M,C,Dk) -> (n,M,C,Dk)
        if self.steep is not None:
            return self._gathered("rows", np.empty(k.shape, k.dtype), P, k)
        if self.factored:
            return (self._masked(P) @ (k * self.w)) * self.u
        return self._masked(P) @ k

    def cols(self, P, q):                                               # (n,M,C,C)ᵀ @ (n,M,C,Dk) -> (n,M,C,Dk)
        if self.steep is not None:
            return self._gathered("cols", np.empty(q.shape, q.dtype), P, q)
        if self.factored:
            return (_t(self._masked(P)) @ (q * self.u)) * self.w
        return _t(self._masked(P)) @ q

    def grads(self, P, q, k, A):
        """``(rows(P, k), cols(P, q), pairs (n, M, C, 1))``: with one decay a head the pair
        ``(i, s)`` adds ``P_is A_is`` (A the scores) to ``dg_j`` for ``s < j <= i``."""
        return self.rows(P, k), self.cols(P, q), crossing.crossing(P * A)[..., None]


class ChannelDecay:
    """A decay a key channel: per sub-block I (rows ``r0:r1``) the diagonal block
    ``E_I = exp(G_i - G_s)`` ``(n, M, c, c, Dk)`` (made when first asked for: the compiled
    forward's scores make its rows as they go) and, below the diagonal, the factors about
    row ``r = r0 - 1``: ``eq_I = exp(G_I - G_r)`` ``(n, M, c, Dk)`` and
    ``ek_I = exp(G_r - G_<I)`` ``(n, M, r0, Dk)``."""

    def __init__(self, a: np.ndarray, sub: int = SUB):
        C = a.shape[2]
        self.a, self.sub = a, sub
        self.cuts = [(r0, min(r0 + sub, C)) for r0 in range(0, C, sub)]
        self.below = []
        mod = jit.load(jit.DECAY) if a.dtype in (np.float32, np.float64) else None
        for r0, r1 in self.cuts:
            eq = ek = None
            if r0 and mod is not None:                                   # the same running products, one pass
                eq = np.empty(a.shape[:2] + (r1 - r0,) + a.shape[3:], a.dtype)
                ek = np.empty(a.shape[:2] + (r0,) + a.shape[3:], a.dtype)
                mod.channel_factors(a, r0, eq, ek)
            elif r0:
                eq = np.cumprod(a[:, :, r0:r1], axis=2)                  # Π_{r < j <= i} a_j  (n,M,c,Dk)
                ek = np.ones(a.shape[:2] + (r0,) + a.shape[3:], a.dtype)  # Π_{s < j <= r} a_j  (n,M,r0,Dk)
                if r0 > 1:
                    ek[:, :, :-1] = np.cumprod(a[:, :, r0 - 1:0:-1], axis=2)[:, :, ::-1]
            self.below.append((eq, ek))

    @cached_property
    def blocks(self):
        """``(r0, r1, E, eq, ek)`` a sub-block."""
        n, M, _, Dk = self.a.shape
        buf = scratch(sum(n * M * (r1 - r0) ** 2 * Dk for r0, r1 in self.cuts), self.a.dtype, DEFAULT, "decay_E")
        buf.fill(0)
        out, at = [], 0
        for (r0, r1), (eq, ek) in zip(self.cuts, self.below):
            size = n * M * (r1 - r0) ** 2 * Dk
            out.append((r0, r1, _products(self.a[:, :, r0:r1], buf[at:at + size].reshape(n, M, r1 - r0, r1 - r0, Dk)),
                        eq, ek))
            at += size
        return out

    def scores(self, q, k, Qg=None, KgT=None):
        n, M, C = q.shape[:3]
        A = np.zeros((n, M, C, C), q.dtype)
        mod = jit.load(jit.DECAY) if q.dtype in (np.float32, np.float64) else None
        if mod is not None:                                              # the diagonal blocks, E made as it goes
            mod.channel_scores(q, k, self.a, A, self.sub)
        for b, ((r0, r1), (eq, ek)) in enumerate(zip(self.cuts, self.below)):
            if mod is None:
                E = self.blocks[b][2]
                A[:, :, r0:r1, r0:r1] = np.einsum("nmid,nmsd,nmisd->nmis", q[:, :, r0:r1], k[:, :, r0:r1], E)
            if r0:                                                       # (n,M,c,Dk) @ (n,M,Dk,r0) -> (n,M,c,r0)
                A[:, :, r0:r1, :r0] = (q[:, :, r0:r1] * eq) @ _t(k[:, :, :r0] * ek)
        return A

    def rows(self, P, k):
        X = np.empty(k.shape, k.dtype)
        for r0, r1, E, eq, ek in self.blocks:
            X[:, :, r0:r1] = np.einsum("nmis,nmsd,nmisd->nmid", P[:, :, r0:r1, r0:r1], k[:, :, r0:r1], E)
            if r0:                                                       # (n,M,c,r0) @ (n,M,r0,Dk) -> (n,M,c,Dk)
                X[:, :, r0:r1] += (P[:, :, r0:r1, :r0] @ (k[:, :, :r0] * ek)) * eq
        return X

    def cols(self, P, q):
        Y = np.zeros(q.shape, q.dtype)
        for r0, r1, E, eq, ek in self.blocks:
            Y[:, :, r0:r1] += np.einsum("nmis,nmid,nmisd->nmsd", P[:, :, r0:r1, r0:r1], q[:, :, r0:r1], E)
            if r0:                                                       # (n,M,r0,c) @ (n,M,c,Dk) -> (n,M,r0,Dk)
                Y[:, :, :r0] += (_t(P[:, :, r0:r1, :r0]) @ (q[:, :, r0:r1] * eq)) * ek
        return Y


    def grads(self, P, q, k, A=None):
        """``(rows(P, k), cols(P, q), pairs)``, ``pairs (n, M, C, Dk)`` the in-chunk scores' share
        of ``dg``: ``Σ_{s < j <= i} P_is q_id k_sd exp(G_id - G_sd)`` (:mod:`qkv.recurrent.crossing`).
        Below a diagonal block the factor about row r splits the pairs by where j lies: in block
        I (the ``exp(G_i - G_r)`` side, ``Σ_{i >= j}`` of ``q ∘ eq ∘ (P Kek)``) or before it (the
        ``exp(G_r - G_s)`` side, ``Σ_{s < j}`` of ``k ∘ ek ∘ (Pᵀ Qeq)``): each term where its
        factor crosses j. In a diagonal block, ``Σ_{i >= j}`` of its rows and cols without the
        diagonal (``exp(0)``, crossing nothing): only pairs of one block of c rows can cancel
        there, and at steep decays they are as small as what they leave."""
        X, Y = np.empty(k.shape, k.dtype), np.zeros(q.shape, q.dtype)
        pairs = np.zeros(q.shape, q.dtype)
        for r0, r1, E, eq, ek in self.blocks:
            qI, kI = q[:, :, r0:r1], k[:, :, r0:r1]
            Pd = P[:, :, r0:r1, r0:r1].copy()
            diag = np.diagonal(Pd, axis1=-2, axis2=-1).copy()[..., None]
            np.einsum("...ii->...i", Pd)[...] = 0
            Xd = np.einsum("nmis,nmsd,nmisd->nmid", Pd, kI, E)
            Yd = np.einsum("nmis,nmid,nmisd->nmsd", Pd, qI, E)
            X[:, :, r0:r1] = Xd + diag * kI
            Y[:, :, r0:r1] += Yd + diag * qI
            if r1 - r0 > 1:                                                 # pairs inside block I (a row alone has
                pairs[:, :, r0:r1] += crossing.later(qI * Xd - kI * Yd, 2)   # none: no 0 · NaN from a NaN input)
            if r0:
                Xb = P[:, :, r0:r1, :r0] @ (k[:, :, :r0] * ek)                  # (n,M,c,r0) @ (n,M,r0,Dk)
                X[:, :, r0:r1] += Xb * eq
                Yb = _t(P[:, :, r0:r1, :r0]) @ (qI * eq)                        # (n,M,r0,c) @ (n,M,c,Dk)
                Y[:, :, :r0] += Yb * ek
                pairs[:, :, r0:r1] += crossing.later(qI * eq * Xb, 2)            # j in I: Σ_{i >= j}
                pairs[:, :, :r0] += crossing.earlier(k[:, :, :r0] * ek * Yb, 2)  # j before I: Σ_{s < j}
        return X, Y, pairs

def _products(a: np.ndarray, E: np.ndarray) -> np.ndarray:
    """``E_is = Π_{s < j <= i} a_j`` for ``s <= i`` (1 on the diagonal), into ``E`` (zeros):
    ``a (n, M, c, Dk) -> E (n, M, c, c, Dk)``, one row from the one before."""
    for i in range(a.shape[2]):
        E[:, :, i, i] = 1
        if i:
            np.multiply(E[:, :, i - 1, :i], a[:, :, i, None], out=E[:, :, i, :i])
    return E


def decay(G: np.ndarray, a: np.ndarray | None, dtype):
    """The in-chunk decays of a slab: ``G (n, M, C, W)`` float64, W = 1 (a head) or Dk;
    ``a = exp(g)`` ``(n, M, C, Dk)`` for a decay a key channel."""
    return HeadDecay(G, dtype) if G.shape[-1] == 1 else ChannelDecay(a)
