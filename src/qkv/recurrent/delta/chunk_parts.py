"""The delta rule's chunks: what the forward and the backward of :mod:`qkv.recurrent.delta.chunk`
both compute from a chunk's own inputs, and the pass of the state from chunk to chunk.

A chunk holds ``C`` positions ``t = 1..C`` (the last chunk padded with ``k = v = q = 0``,
``beta = g = 0``: a padded step leaves the state as it was). All arrays are laid out
``(B, H, N, C, ·)`` with ``N`` chunks; inside a chunk (``S_0`` its start state)::

    γ_t  = g_1 + ... + g_t                       (γ_0 = 0; the decay from the start is e^{γ_t})
    D_ts = exp(γ_t - γ_s) for s <= t, else 0     ((C, C): only exponents <= 0, never e^{-γ})
    A    = strictly_lower(diag(beta) (K Kᵀ) ∘ D)  the UT system; L = I + A
    Tinv = L⁻¹                                  unit lower triangular
    P    = (Q Kᵀ) ∘ D                            the masked in-chunk scores (diagonal kept)
    Kc   = diag(e^{γ_C - γ}) K                  the keys as they reach the chunk's end

(``K Kᵀ`` and ``Q Kᵀ`` as one product ``[K; Q] Kᵀ``) and, once a chunk in order, the reads
of its start state, its corrections and its end state (derived in :mod:`qkv.recurrent.delta.chunk`)::

    [Kg S_0; Qg S_0] = diag(e^γ) ([K; Q] S_0)                  one (2C, Dk) @ (Dk, Dv) product
    X   = V - Kg S_0                            the residuals
    U   = Tinv diag(beta) X                     (C, C) @ (C, Dv)
    S_C = e^{γ_C} S_0 + Kcᵀ U                    (Dk, C) @ (C, Dv)

**The triangular inverse** ``(I + A)⁻¹`` (``A`` strictly lower) by recursive doubling of
the diagonal blocks: with the blocks of size ``s`` inverted, each pair of them becomes one
block of size ``2s``::

    [[L11,   0], [L21, L22]]⁻¹ = [[X11, 0], [-X22 L21 X11, X22]]     (Xii = Lii⁻¹)

from ``s = 1`` (``Xii = 1``) to the chunk (padded with zeros to a power of two): ``log2 C``
levels of batched products over every chunk at once, ``C³/3`` multiply-adds a chunk, and
no loop over rows. It is the recursive triangular inversion whose error is bounded like
forward substitution's (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 14, triangular matrices).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ... import jit
from ..decay.intra import FLUSH  # float32 decay factors below are 0 (the compiled side: .compiled)

CHUNK = 64          # positions a chunk when the caller gives none (measured: see delta.py)
LOG_FLOOR = 1e4     # g below -LOG_FLOOR counts as -LOG_FLOOR (e^g is 0 either way)


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
    out = x.reshape((B, H, N * C) + x.shape[4:])
    return out if N * C == T else np.ascontiguousarray(out[:, :, :T])


def _diagonal_blocks(X: np.ndarray, size: int) -> np.ndarray:
    """The ``size × size`` blocks on the diagonal of ``X (..., P, P)`` as a writable view
    ``(..., P // size, size, size)``."""
    *lead, P, _ = X.shape
    row, col = X.strides[-2:]
    return np.lib.stride_tricks.as_strided(
        X, tuple(lead) + (P // size, size, size), X.strides[:-2] + (size * (row + col), row, col))


def unit_lower_inverse(A: np.ndarray) -> np.ndarray:
    """``(I + A)⁻¹`` for ``A (..., C, C)`` zero above its diagonal (what is on the diagonal is
    ignored): unit lower triangular, computed in ``A``'s place (``A`` is overwritten).

    Each level reads its ``L21`` blocks before writing ``X21`` where they were; the blocks
    of later levels lie elsewhere, so they are still ``A``'s when their level comes.
    With the ``fast`` extra, forward substitution instead (:mod:`qkv.recurrent.delta.compiled`).
    """
    C = A.shape[-1]
    mod = jit.load(jit.DELTA) if A.flags.c_contiguous and A.dtype in (np.float32, np.float64) else None
    if mod is not None:
        mod.unit_lower_inverse(A.reshape(-1, C, C))
        return A
    P = 1 << max(C - 1, 0).bit_length()
    X = A if P == C else np.pad(A, [(0, 0)] * (A.ndim - 2) + [(0, P - C), (0, P - C)])
    idx = np.arange(P)
    X[..., idx, idx] = 1                                             # the inverted blocks of size 1
    X[..., idx[1::2], idx[:-1:2]] *= -1                              # size 2: -L21 (X11 = X22 = 1)
    s = 2
    while s < P:
        Xb = _diagonal_blocks(X, 2 * s)                              # (..., P/2s, 2s, 2s) views
        # the merged block's lower left: -X22 L21 X11, each (..., P/2s, s, s)
        Xb[..., s:, :s] = -((Xb[..., s:, s:] @ Xb[..., s:, :s]) @ Xb[..., :s, :s])
        s *= 2
    return X[..., :C, :C]


@dataclass
class Chunks:
    """One call's chunked inputs and the per-chunk quantities of the module docstring."""
    T: int
    q: np.ndarray          # (B, H, N, C, Dk)
    k: np.ndarray          # (B, H, N, C, Dk)
    v: np.ndarray          # (B, H, N, C, Dv)
    beta: np.ndarray       # (B, H, N, C)
    gated: bool            # a decay was given (else every decay factor is 1)
    eg: np.ndarray         # (B, H, N, C)    e^{γ_t}
    eC: np.ndarray         # (B, H, N)       e^{γ_C}
    eCg: np.ndarray        # (B, H, N, C)    e^{γ_C - γ_t}
    D: np.ndarray | None   # (B, H, N, C, C) e^{γ_t - γ_s}, zero above the diagonal (None: not kept)
    KK: np.ndarray         # (B, H, N, C, C) K Kᵀ
    P: np.ndarray          # (B, H, N, C, C) (Q Kᵀ) ∘ D
    Tinv: np.ndarray       # (B, H, N, C, C) (I + A)⁻¹
    KQ: np.ndarray         # (B, H, N, 2C, Dk) [K; Q]: the reads of S_0 (k and q are its views)
    Kc: np.ndarray         # (B, H, N, C, Dk) diag(e^{γ_C - γ}) K
    # With grouped value heads (the forward), q, k and KQ have the key heads, HV / H times fewer
    # than the rest, and so has Kc without a decay (it is k)


def cumulative(g: np.ndarray | None) -> np.ndarray | None:
    """``γ (B, H, N, C)`` in float64 from the chunked ``g`` (None: no decay).

    ``γ`` and its differences are formed in float64 whatever the dtype: ``γ_t - γ_s`` of two
    long sums in float32 would lose the small steps beside a large one (g = -30 then -0.01:
    the difference of two sums near -30 keeps ``-0.01`` to about ``2e-6``, a relative 2e-4).
    ``g`` is floored at ``-LOG_FLOOR``, where ``e^g`` is already 0 in float64, so that no
    sum of finite ``g`` overflows to ``-inf`` (and no ``-inf - -inf`` makes a NaN).
    """
    return None if g is None else np.cumsum(np.maximum(g, -LOG_FLOOR), axis=-1, dtype=np.float64)


def decays(gamma: np.ndarray | None, shape, dtype):
    """``(e^γ, e^{γ_C}, e^{γ_C - γ})`` in ``dtype`` (all ones without a decay)."""
    if gamma is None:
        ones = np.ones(shape, dtype)
        return ones, np.ones(shape[:-1], dtype), ones
    def ex(x):                                                       # exp in float64, then rounded once
        e = np.exp(x).astype(dtype, copy=False)
        if dtype == np.float32:
            e[e < FLUSH] = 0                                         # as qkv.recurrent.delta.compiled does
        return e
    return ex(gamma), ex(gamma[..., -1]), ex(gamma[..., -1:] - gamma)


def decay_matrix(gamma: np.ndarray | None, shape, dtype) -> np.ndarray:
    """``D (B, H, N, C, C)``: ``e^{γ_t - γ_s}`` on and below the diagonal, 0 above."""
    C = shape[-1]
    lower = np.tril(np.ones((C, C), dtype=bool))
    if gamma is None:
        return np.broadcast_to(lower.astype(dtype), shape + (C,))
    D = np.empty(shape + (C,), dtype=dtype)
    np.subtract(gamma[..., :, None], gamma[..., None, :], out=D, casting="same_kind")  # (B,H,N,C,C) γ_t - γ_s
    np.minimum(D, np.where(lower, 0, -np.inf).astype(dtype), out=D)  # <= 0 below, -inf above the diagonal
    return np.exp(D, out=D)


def _systems(scores, gamma, beta, keep: bool):
    """``(D or None, Tinv)``, ``P = (Q Kᵀ) ∘ D`` made in ``scores``' lower half, in place: with
    the ``fast`` extra in one compiled pass a chunk (:func:`qkv.recurrent.delta.compiled.chunk_systems`;
    ``keep``: D kept for the backward), else NumPy's passes (D always made)."""
    *lead, C2, C = scores.shape
    dt = scores.dtype
    KK, P = scores[..., :C, :], scores[..., C:, :]
    mod = jit.load(jit.DELTA) if dt in (np.float32, np.float64) else None
    if mod is None:
        D = decay_matrix(gamma, beta.shape, dt)
        A = KK * D                                                   # zero above the diagonal
        A *= beta[..., :, None]
        P *= D
        return D, unit_lower_inverse(A)                              # (its diagonal is not A's)
    M = int(np.prod(lead))
    Tinv = np.empty(tuple(lead) + (C, C), dt)
    D = np.empty(tuple(lead) + (C, C), dt) if keep else None
    gam = np.zeros((M, C)) if gamma is None else np.ascontiguousarray(gamma).reshape(M, C)
    mod.chunk_systems(scores.reshape(M, C2, C), gam, np.ascontiguousarray(beta, dtype=dt).reshape(M, C),
                      Tinv.reshape(M, C, C), (D if keep else np.empty((0, C, C), dt)).reshape(-1, C, C))
    return D, Tinv


def prepare(q, k, v, beta, g, C: int, keep: bool = True) -> Chunks:
    """The chunked inputs and every quantity that needs no state (batched over all chunks);
    ``keep=False`` (the forward): ``D`` may be left out (None)."""
    T, G = q.shape[2], v.shape[1] // q.shape[1]
    KQ = np.concatenate([to_chunks(k, C), to_chunks(q, C)], axis=-2)   # (B,H,N,2C,Dk): [K; Q]
    k, q = KQ[..., :C, :], KQ[..., C:, :]
    v, beta = to_chunks(v, C), to_chunks(beta, C)
    gamma = cumulative(None if g is None else to_chunks(g, C))
    eg, eC, eCg = decays(gamma, beta.shape, q.dtype)
    scores = KQ @ np.swapaxes(k, -1, -2)                             # (B,H,N,2C,Dk) @ (B,H,N,Dk,C) -> (B,H,N,2C,C)
    if G > 1:                                                        # grouped value heads: a key head's scores
        scores = np.repeat(scores, G, axis=1)                        # for each of its value heads' P and A
    D, Tinv = _systems(scores, gamma, beta, keep)
    KK, P = scores[..., :C, :], scores[..., C:, :]
    Kc = k if g is None else _by_value_head(k, G, eCg[..., None])
    return Chunks(T, q, k, v, beta, g is not None, eg, eC, eCg, D, KK, P, Tinv, KQ, Kc)


def _by_value_head(x: np.ndarray, G: int, f: np.ndarray) -> np.ndarray:
    """``x (B, H, ...) · f (B, H·G, ...)``: each value head's factor times its key head's ``x``
    (``x · f`` where ``G = 1``), C-ordered ``(B, H·G, ...)``; each entry one rounded product."""
    if G == 1:
        return x * f
    B, H = x.shape[:2]
    return (x[:, :, None] * f.reshape((B, H, G) + f.shape[2:])).reshape((B, H * G) + x.shape[2:])


@dataclass
class Passed:
    """The forward's pass through the chunks: what the output and the backward read."""
    U: np.ndarray          # (B, H, N, C, Dv) the corrections
    KS: np.ndarray         # (B, H, N, C, Dv) diag(e^γ) K S_0 (the residuals are X = V - KS)
    QS: np.ndarray         # (B, H, N, C, Dv) diag(e^γ) Q S_0, the reads of the start states
    starts: np.ndarray | None  # (B, H, N, Dk, Dv) each chunk's S_0 (kept for the backward)
    S: np.ndarray          # (B, H, Dk, Dv) the final state
    O: np.ndarray | None = None  # (B, H, N, C, Dv) the outputs, where the compiled pass made them


def pass_states(ch: Chunks, S0: np.ndarray, keep: bool = False, scale: float | None = None,
                out: np.ndarray | None = None) -> Passed:
    """The state through the chunks, once a chunk (``keep``: also every chunk's start state);
    float32 in one compiled loop where the ``fast`` extra is (``delta_compiled.pass_chunks``),
    which given ``scale`` makes the outputs too (``Passed.O``: ``out`` where given, a C-ordered
    ``(B, H, N, C, Dv)``)."""
    B, H, N, C, Dk = ch.v.shape[:4] + ch.k.shape[-1:]
    S = S0
    starts = np.empty((B, H, N, Dk, S0.shape[-1]), dtype=S0.dtype) if keep else None
    reads = np.empty((B, H, N, 2 * C, S0.shape[-1]), dtype=S0.dtype)
    U = np.empty(ch.v.shape, dtype=S0.dtype)
    mod = jit.load(jit.DELTA) if S0.dtype == np.float32 and min(C, Dk, S0.shape[-1]) > 1 else None
    if mod is not None and mod.SGEMM and mod.ILP64:                  # compiled, NumPy's own sgemm: its bits (not gemv's)
        S = np.array(S0, dtype=np.float32, order="C")
        O = out if out is not None and scale is not None else \
            np.empty(ch.v.shape if scale is not None else (B, H, 0, C, S0.shape[-1]), np.float32)
        mod.pass_chunks((mod.SGEMM, int(mod.ILP64)), ch.KQ, ch.v, ch.beta, ch.eg, ch.eC, ch.Kc, ch.Tinv, ch.gated, S,
                        reads, U, starts if keep else np.empty((B, H, 0, Dk, S0.shape[-1]), np.float32), ch.P, O,
                        np.float32(1.0 if scale is None else scale))
        return Passed(U, reads[..., :C, :], reads[..., C:, :], starts, S, O if scale is not None else None)
    if ch.KQ.shape[1] != H:                                          # grouped value heads: as repeated
        G = H // ch.KQ.shape[1]
        ch = replace(ch, KQ=np.repeat(ch.KQ, G, axis=1), Kc=ch.Kc if ch.gated else np.repeat(ch.Kc, G, axis=1))
    eg2 = np.concatenate([ch.eg, ch.eg], axis=-1)[..., None]         # (B,H,N,2C,1): e^γ on both halves
    for n in range(N):
        if keep:
            starts[:, :, n] = S
        np.matmul(ch.KQ[:, :, n], S, out=reads[:, :, n])            # (B,H,2C,Dk) @ (B,H,Dk,Dv) -> (B,H,2C,Dv)
        if ch.gated:
            reads[:, :, n] *= eg2[:, :, n]                          # [Kg S_0; Qg S_0]
        R = ch.beta[:, :, n, :, None] * (ch.v[:, :, n] - reads[:, :, n, :C])
        np.matmul(ch.Tinv[:, :, n], R, out=U[:, :, n])              # (B,H,C,C) @ (B,H,C,Dv) -> (B,H,C,Dv)
        S = ch.eC[:, :, n, None, None] * S + np.swapaxes(ch.Kc[:, :, n], -1, -2) @ U[:, :, n]  # (B,H,Dk,C) @ (B,H,C,Dv)
    return Passed(U, reads[..., :C, :], reads[..., C:, :], starts, S)
