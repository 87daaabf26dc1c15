"""The delta rule's chunks: what the forward and the backward of :mod:`qkv.kernels.delta`
both compute from a chunk's own inputs, and the pass of the state from chunk to chunk.

A chunk holds ``C`` positions ``t = 1..C`` (the last chunk padded with ``k = v = q = 0``,
``beta = g = 0``: a padded step leaves the state as it was). All arrays are laid out
``(B, H, N, C, ·)`` with ``N`` chunks; inside a chunk (``S_0`` its start state)::

    γ_t  = g_1 + ... + g_t                       (γ_0 = 0; the decay from the start is e^{γ_t})
    D_ts = exp(γ_t - γ_s) for s <= t, else 0     ((C, C): only exponents <= 0, never e^{-γ})
    A    = strictly_lower(diag(beta) (K Kᵀ) ∘ D)  the UT system; L = I + A
    Tinv = L⁻¹                                  unit lower triangular
    W    = Tinv (diag(beta e^γ) K)    (C, Dk)    U0 = Tinv (diag(beta) V)   (C, Dv)
    P    = (Q Kᵀ) ∘ D                            the masked in-chunk scores (diagonal kept)
    Kc   = diag(e^{γ_C - γ}) K                  the keys as they reach the chunk's end

and the chunk's corrections and end state (derived in :mod:`qkv.kernels.delta`)::

    U   = U0 - W S_0                            (C, Dv)
    S_C = e^{γ_C} S_0 + Kcᵀ U

**The triangular inverse** ``(I + A)⁻¹`` (``A`` strictly lower) by recursive doubling of
the diagonal blocks: with the blocks of size ``s`` inverted, each pair of them becomes one
block of size ``2s``::

    [[L11,   0], [L21, L22]]⁻¹ = [[X11, 0], [-X22 L21 X11, X22]]     (Xii = Lii⁻¹)

from ``s = 1`` (``Xii = 1``) to the chunk (padded with zeros to a power of two): ``log2 C``
levels of batched products over every chunk at once, ``C³/3`` multiply-adds a chunk, and
no loop over rows. It is the recursive triangular inversion whose error is bounded like
forward substitution's (Higham, *Accuracy and Stability of Numerical Algorithms*, §14.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK = 64          # positions a chunk when the caller gives none (measured: see delta.py)
_SMALL = 8          # blocks up to this size are multiplied by broadcasting, not BLAS calls


def to_chunks(x: np.ndarray, C: int) -> np.ndarray:
    """``(B, H, T, ...)`` -> ``(B, H, N, C, ...)``, zero-padded at the end to ``N·C`` positions."""
    B, H, T = x.shape[:3]
    N = -(-T // C)
    if N * C != T:
        pad = np.zeros((B, H, N * C - T) + x.shape[3:], dtype=x.dtype)
        x = np.concatenate([x, pad], axis=2)
    return x.reshape((B, H, N, C) + x.shape[3:])


def from_chunks(x: np.ndarray, T: int) -> np.ndarray:
    """``(B, H, N, C, ...)`` -> ``(B, H, T, ...)`` (the padding dropped)."""
    B, H, N, C = x.shape[:4]
    return x.reshape((B, H, N * C) + x.shape[4:])[:, :, :T]


def _bmm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Batched ``a @ b``; tiny blocks by broadcasting (one pass instead of a BLAS call each)."""
    if a.shape[-1] <= _SMALL and a.shape[-2] <= _SMALL:
        return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)     # (...,m,s,1)*(...,1,s,n) -> (...,m,n)
    return a @ b


def unit_lower_inverse(A: np.ndarray) -> np.ndarray:
    """``(I + A)⁻¹`` for ``A (..., C, C)`` strictly lower triangular: unit lower triangular."""
    C = A.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()
    if P != C:
        A = np.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, P - C), (0, P - C)])
    lead = A.shape[:-2]
    X = np.ones(lead + (P, 1, 1), dtype=A.dtype)                    # the inverted diagonal blocks
    s = 1
    while s < P:
        n = P // (2 * s)
        pairs = np.diagonal(A.reshape(lead + (n, 2 * s, n, 2 * s)), axis1=-4, axis2=-2)  # (...,2s,2s,n)
        L21 = np.moveaxis(pairs, -1, -3)[..., s:, :s]               # (..., n, s, s)
        X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        merged = np.zeros(lead + (n, 2 * s, 2 * s), dtype=A.dtype)
        merged[..., :s, :s] = X11
        merged[..., s:, s:] = X22
        merged[..., s:, :s] = -_bmm(_bmm(X22, L21), X11)           # (...,n,s,s) products
        X, s = merged, 2 * s
    return X[..., 0, :C, :C]


@dataclass
class Chunks:
    """One call's chunked inputs and the per-chunk quantities of the module docstring."""
    T: int
    q: np.ndarray          # (B, H, N, C, Dk)
    k: np.ndarray          # (B, H, N, C, Dk)
    v: np.ndarray          # (B, H, N, C, Dv)
    beta: np.ndarray       # (B, H, N, C)
    gamma: np.ndarray | None   # (B, H, N, C) cumulative log decay in the chunk; None ungated
    eg: np.ndarray         # (B, H, N, C)    e^{γ_t}
    eC: np.ndarray         # (B, H, N)       e^{γ_C}
    D: np.ndarray          # (B, H, N, C, C) e^{γ_t - γ_s}, zero above the diagonal
    KK: np.ndarray         # (B, H, N, C, C) K Kᵀ
    Tinv: np.ndarray       # (B, H, N, C, C) (I + A)⁻¹
    W: np.ndarray          # (B, H, N, C, Dk)
    U0: np.ndarray         # (B, H, N, C, Dv)
    Kc: np.ndarray         # (B, H, N, C, Dk)
    P: np.ndarray          # (B, H, N, C, C) (Q Kᵀ) ∘ D


def decays(g: np.ndarray | None, C: int, shape, dtype):
    """``(γ, e^γ, e^{γ_C}, D)`` from ``g (B, H, N, C)`` (None: no decay, all ones)."""
    lower = np.tril(np.ones((C, C), dtype=bool))
    if g is None:
        return None, np.ones(shape, dtype), np.ones(shape[:-1], dtype), np.broadcast_to(lower.astype(dtype), shape + (C,))
    gamma = np.cumsum(g, axis=-1)                                    # (B,H,N,C)
    diff = gamma[..., :, None] - gamma[..., None, :]                 # (B,H,N,C,C) γ_t - γ_s
    diff = np.where(lower, np.minimum(diff, 0), -np.inf)             # only exponents <= 0
    return gamma, np.exp(gamma), np.exp(gamma[..., -1]), np.exp(diff)


def prepare(q, k, v, beta, g, C: int) -> Chunks:
    """The chunked inputs and every quantity that needs no state (batched over all chunks)."""
    T = q.shape[2]
    q, k, v, beta = (to_chunks(x, C) for x in (q, k, v, beta))
    gamma, eg, eC, D = decays(None if g is None else to_chunks(g, C), C, beta.shape, q.dtype)
    kt = np.swapaxes(k, -1, -2)
    KK = k @ kt                                                      # (B,H,N,C,Dk) @ (B,H,N,Dk,C) -> (B,H,N,C,C)
    A = beta[..., :, None] * KK * D
    idx = np.arange(C)
    A[..., idx, idx] = 0                                             # strictly lower
    Tinv = unit_lower_inverse(A)
    W = Tinv @ ((beta * eg)[..., None] * k)                          # (B,H,N,C,C) @ (B,H,N,C,Dk) -> (B,H,N,C,Dk)
    U0 = Tinv @ (beta[..., None] * v)                                # (B,H,N,C,C) @ (B,H,N,C,Dv) -> (B,H,N,C,Dv)
    Kc = k if gamma is None else k * np.exp(gamma[..., -1:] - gamma)[..., None]
    P = (q @ kt) * D                                                 # (B,H,N,C,Dk) @ (B,H,N,Dk,C) -> (B,H,N,C,C)
    return Chunks(T, q, k, v, beta, gamma, eg, eC, D, KK, Tinv, W, U0, Kc, P)


def pass_states(ch: Chunks, S0: np.ndarray):
    """The state through the chunks: ``(starts (B,H,N,Dk,Dv), U (B,H,N,C,Dv), S_T)``."""
    B, H, N, C, Dk = ch.k.shape
    S = S0
    starts = np.empty((B, H, N, Dk, S0.shape[-1]), dtype=S0.dtype)
    U = np.empty(ch.U0.shape, dtype=S0.dtype)
    for n in range(N):
        starts[:, :, n] = S
        U[:, :, n] = ch.U0[:, :, n] - ch.W[:, :, n] @ S              # (B,H,C,Dk) @ (B,H,Dk,Dv) -> (B,H,C,Dv)
        S = ch.eC[:, :, n, None, None] * S + np.swapaxes(ch.Kc[:, :, n], -1, -2) @ U[:, :, n]  # (B,H,Dk,C) @ (B,H,C,Dv)
    return starts, U, S
