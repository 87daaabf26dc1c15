"""One chunk's quantities of the chunked dplr recurrence, and the pass of the state across
chunks: the pieces :mod:`qkv.recurrent.generalized_delta.chunk` (which derives them) and
:mod:`qkv.recurrent.generalized_delta.backward` share.

Arrays are cut into chunks of C steps, ``(B, H, T, D) -> (B, H, N, C, D)``; a last partial
chunk is completed with identity steps (``g = 0``, ``q = k = v = a = b = 0``: the state
passes unchanged and nothing is added). Below ``…`` is ``(B, H, N)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scores import head_decays, running_product, scores

INVERSE_LEAF = 16   # rows of the diagonal blocks inverted by substitution
GROUP_ELEMENTS = 1 << 17   # B·H·steps·Dk of one group of chunks done at once (a cache-sized piece;
                           # 2^16 to 2^18 measured alike, 2^20 and all at once 1.5-2x slower)


def to_chunks(x: np.ndarray, C: int) -> np.ndarray:
    """``(B, H, T, ·) -> (B, H, N, C, ·)`` (or ``(B, H, T) -> (B, H, N, C)``), zero steps appended."""
    T = x.shape[2]
    N = -(-T // C)
    if N * C != T:
        x = np.pad(x, [(0, 0), (0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(x.shape[:2] + (N, C) + x.shape[3:])


def from_chunks(x: np.ndarray, T: int) -> np.ndarray:
    """The inverse of :func:`to_chunks`."""
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :T]


def groups(T: int, C: int, BH: int, Dk: int) -> list[slice]:
    """The step ranges done at once: whole chunks, about :data:`GROUP_ELEMENTS` numbers an
    input: the many passes over a group's arrays then stay in cache."""
    steps = max(C, GROUP_ELEMENTS // max(1, BH * Dk) // C * C)
    return [slice(s, min(s + steps, T)) for s in range(0, T, steps)]


def unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I - L)^{-1}`` for ``L (…, C, C)`` strictly lower triangular (zero above the
    diagonal is not assumed: only the strict lower part is read).

    Halves: ``[[I - L11, 0], [-L21, I - L22]]^{-1} = [[P11, 0], [P22 L21 P11, P22]]``;
    blocks of at most :data:`INVERSE_LEAF` rows by substitution, ``P[i, :i] = L[i, :i] P[:i, :i]``.
    """
    C = L.shape[-1]
    P = np.zeros_like(L)
    if C <= INVERSE_LEAF:
        for i in range(C):
            P[..., i, :i] = np.einsum("...j,...jk->...k", L[..., i, :i], P[..., :i, :i])
            P[..., i, i] = 1
        return P
    h = C // 2
    if C % 2 == 0:                                          # both halves in one call: C/2 rows to substitute
        halves = unit_lower_inverse(np.stack([L[..., :h, :h], L[..., h:, h:]], axis=-3))
        P11, P22 = halves[..., 0, :, :], halves[..., 1, :, :]
    else:
        P11, P22 = unit_lower_inverse(L[..., :h, :h]), unit_lower_inverse(L[..., h:, h:])
    P[..., :h, :h], P[..., h:, h:] = P11, P22
    P[..., h:, :h] = P22 @ (L[..., h:, :h] @ P11)          # (…,C-h,C-h) @ (…,C-h,h) @ (…,h,h)
    return P


def _swap(x):
    return np.swapaxes(x, -1, -2)


@dataclass
class Chunks:
    """The chunk-local quantities (``…`` = ``(B, H, N)``; ``[, Dk]``: absent for one decay a head).

    X = [q, a], Y = [k, b]  (…, 2, C, Dk)        v (…, C, Dv)
    e = exp(g) (…, C, Dk or 1), the steps' decays; with one decay a head also
    D (…, 2, C, C) the products' decays exp(Gx_t - G_s) (scores.head_decays; else None)
    A (…, 2, 2, C, C) = [[qk, qb], [ak, ab]] (dplr_scores), P = (I - A_ab)^{-1}
    qt = q ∘ exp G, at = a ∘ exp(G_{t-1}), kt = k ∘ exp(G_C - G), bt = b ∘ exp(G_C - G),
    the factors fG = exp G, fGex = exp G_{t-1}, end = exp(G_C - G) and eC = exp G_C
    U = P A_ak v (…, C, Dv), W = P at (…, C, Dk)
    M = diag(exp G_C) + btᵀ W (…, Dk, Dk), Hc = ktᵀ v + btᵀ U (…, Dk, Dv): S_out = M S_in + Hc
    """
    X: np.ndarray
    Y: np.ndarray
    v: np.ndarray
    D: np.ndarray | None
    e: np.ndarray
    per_head: bool
    A: np.ndarray
    P: np.ndarray
    qt: np.ndarray
    at: np.ndarray
    kt: np.ndarray
    bt: np.ndarray
    fG: np.ndarray           # (…, C, Dk or 1)
    fGex: np.ndarray
    end: np.ndarray
    eC: np.ndarray           # (…, Dk or 1)
    U: np.ndarray
    W: np.ndarray
    M: np.ndarray | None
    Hc: np.ndarray


def _factors(e: np.ndarray):
    """From the steps' decays ``e (…, C, Dk or 1)``, running products (never an exp of a
    positive number, never a division): ``exp G_t``, ``exp G_{t-1}``, ``exp(G_C - G_t)``, ``exp G_C``."""
    fG = running_product(e)
    fGex = np.ones_like(e)
    fGex[..., 1:, :] = fG[..., :-1, :]
    end = np.ones_like(e)
    end[..., :-1, :] = running_product(e[..., 1:, :], reverse=True)        # e_{t+1} ⋯ e_C
    return fG, fGex, end, fG[..., -1, :]


def prepare(q, k, v, a, b, g, C: int, transition: bool = True) -> Chunks:
    """Every chunk's quantities at once (nothing here depends on the state); ``M`` None unless
    ``transition`` (the compiled backward reads it through its structure ``diag(eC) + btᵀ W``)."""
    per_head = g.ndim == 3
    qc, kc, vc, ac, bc, gc = (to_chunks(x, C) for x in (q, k, v, a, b, g))
    D = head_decays(gc, q.dtype) if per_head else None
    X, Y = np.stack([qc, ac], axis=-3), np.stack([kc, bc], axis=-3)       # (…,2,C,Dk)
    e = np.exp(gc[..., None] if per_head else gc)                          # the steps' decays (…,C,Dk or 1)
    A = scores(X, Y, D, e)                                                  # (…,2,2,C,C)
    P = unit_lower_inverse(A[..., 1, 1, :, :])
    fG, fGex, end, eC = _factors(e)
    qt, at = qc * fG, ac * fGex
    kt, bt = kc * end, bc * end
    U = P @ (A[..., 1, 0, :, :] @ vc)                                       # (…,C,C) @ (…,C,C) @ (…,C,Dv)
    W = P @ at                                                              # (…,C,C) @ (…,C,Dk)
    M = None
    if transition:
        M = _swap(bt) @ W                                                   # (…,Dk,C) @ (…,C,Dk) -> (…,Dk,Dk)
        i = np.arange(M.shape[-1])
        M[..., i, i] += eC                                                  # + diag(exp G_C)
    Hc = _swap(kt) @ vc + _swap(bt) @ U                                     # (…,Dk,C) @ (…,C,Dv) -> (…,Dk,Dv)
    return Chunks(X, Y, vc, D, e, per_head, A, P, qt, at, kt, bt, fG, fGex, end, eC, U, W, M, Hc)


def states(ch: Chunks, S0) -> tuple[np.ndarray, np.ndarray]:
    """``(S_in (B, H, N, Dk, Dv), S_T)``: the state entering every chunk, and the last one."""
    B, H, N, Dk, Dv = ch.Hc.shape
    S = np.zeros((B, H, Dk, Dv), ch.Hc.dtype) if S0 is None else S0.astype(ch.Hc.dtype)
    S_in = np.empty_like(ch.Hc)
    for n in range(N):
        S_in[:, :, n] = S
        S = ch.M[:, :, n] @ S + ch.Hc[:, :, n]                              # (B,H,Dk,Dk) @ (B,H,Dk,Dv)
    return S_in, S
