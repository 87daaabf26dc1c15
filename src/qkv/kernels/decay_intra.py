"""The decayed products inside the chunks of :mod:`qkv.kernels.decay`.

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
decay that underflows is one whose true value is below the smallest float.

**A decay a key channel** (``G`` of width Dk): the factor differs per channel and cannot be
pulled out of the sum over d. Splitting ``exp(G_i - G_s) = exp(G_i) exp(-G_s)`` would make
one factor overflow (``exp(30·C)`` for decays of ``exp(-30)`` a step). So the chunk is cut
into sub-blocks of c rows (:data:`SUB`), and a pair of them is handled by where it lies:

* below the diagonal (rows of sub-block I, columns of an earlier J): factor about the last
  row ``r`` before I, with ``s <= r < i``::

      exp(G_i - G_s) = exp(G_i - G_r) · exp(G_r - G_s),     both factors in [0, 1]

  so ``A[I, <I] = (Q_I ∘ exp(G_I - G_r)) (K_<I ∘ exp(G_r - G_<I))ᵀ`` is one matrix product;
  rows and cols factor the same way.
* on the diagonal: the ``(c, c, Dk)`` block of ``exp(G_i - G_s)`` itself, element by
  element, masked to ``s <= i`` before the exp, then contracted over d.

Cost a row: about ``C/(2c) + c`` exps a key channel and the products; ``c`` balances the two.

**Precision.** ``G`` is a cumulative sum and differences of it lose digits in proportion
to its size (``|G|`` up to ``30·C``); the sums and differences are taken in float64 and
rounded to the compute dtype only as the argument of the exp, so each decay factor is
within an ulp or two of ``exp`` of the exact difference.
"""
from __future__ import annotations

import numpy as np

from .flash.tiles import DEFAULT, scratch

SUB = 16   # rows of a diagonal sub-block (decay a key channel)


def _t(x):
    return np.swapaxes(x, -1, -2)


def _exp(x64: np.ndarray, dtype) -> np.ndarray:
    """``exp`` of a float64 argument, computed in the compute dtype."""
    return np.exp(x64.astype(dtype, copy=False))


def _lower(G_rows: np.ndarray, G_cols: np.ndarray, dtype) -> np.ndarray:
    """``exp(G_i - G_s)`` where ``s <= i`` and 0 above the diagonal.

    ``G_rows (..., c, W)``, ``G_cols (..., c, W)`` float64 -> ``(..., c, c, W)``."""
    c = G_rows.shape[-2]
    diff = G_rows[..., :, None, :] - G_cols[..., None, :, :]          # (...,c,c,W)
    below = np.tri(c, dtype=bool)[:, :, None]
    return _exp(np.where(below, diff, -np.inf), dtype)


class HeadDecay:
    """One decay a head: the ``(C, C)`` factor ``D`` of a slab of chunks ``(n, M, C, C)``."""

    def __init__(self, G: np.ndarray, dtype):
        self.D = _lower(G, G, dtype)[..., 0]                            # (n,M,C,C)

    def scores(self, q, k):
        return (q @ _t(k)) * self.D                                     # (n,M,C,Dk) @ (n,M,Dk,C) -> (n,M,C,C)

    def rows(self, P, k):
        return (P * self.D) @ k                                         # (n,M,C,C) @ (n,M,C,Dk) -> (n,M,C,Dk)

    def cols(self, P, q):
        return _t(P * self.D) @ q                                       # (n,M,C,C)ᵀ @ (n,M,C,Dk) -> (n,M,C,Dk)


class ChannelDecay:
    """A decay a key channel: per sub-block I (rows ``r0:r1``) the diagonal block
    ``E_I = exp(G_i - G_s)`` ``(n, M, c, c, Dk)`` and, below the diagonal, the factors about
    row ``r = r0 - 1``: ``eq_I = exp(G_I - G_r)`` ``(n, M, c, Dk)`` and
    ``ek_I = exp(G_r - G_<I)`` ``(n, M, r0, Dk)``."""

    def __init__(self, a: np.ndarray, sub: int = SUB):
        n, M, C, Dk = a.shape
        cuts = [(r0, min(r0 + sub, C)) for r0 in range(0, C, sub)]
        buf = scratch(sum(n * M * (r1 - r0) ** 2 * Dk for r0, r1 in cuts), a.dtype, DEFAULT, "decay_E")
        buf.fill(0)
        self.blocks, at = [], 0
        for r0, r1 in cuts:
            size = n * M * (r1 - r0) ** 2 * Dk
            E = _products(a[:, :, r0:r1], buf[at:at + size].reshape(n, M, r1 - r0, r1 - r0, Dk))
            at += size
            eq = ek = None
            if r0:
                eq = np.cumprod(a[:, :, r0:r1], axis=2)                  # Π_{r < j <= i} a_j  (n,M,c,Dk)
                ek = np.ones(a.shape[:2] + (r0,) + a.shape[3:], a.dtype)  # Π_{s < j <= r} a_j  (n,M,r0,Dk)
                if r0 > 1:
                    ek[:, :, :-1] = np.cumprod(a[:, :, r0 - 1:0:-1], axis=2)[:, :, ::-1]
            self.blocks.append((r0, r1, E, eq, ek))

    def scores(self, q, k):
        n, M, C = q.shape[:3]
        A = np.zeros((n, M, C, C), q.dtype)
        for r0, r1, E, eq, ek in self.blocks:
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
