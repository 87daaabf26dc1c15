"""The delta rule with a decay a key channel (Kimi Delta Attention, KDA) in chunks: the fast
path of :func:`qkv.recurrent.delta_rule` when ``log_decay`` is ``(B, H, T, Dk)``; the step
loop :func:`qkv.recurrent.delta.naive.delta_forward` is its oracle.

**The recurrence.** Per (batch, head), ``S (Dk, Dv)``, ``g_t (Dk,)``::

    S'  = diag(e^{g_t}) S_{t-1}
    u_t = beta_t (v_t - S'ᵀ k_t)
    S_t = S' + k_t u_tᵀ,        o_t = scale · S_tᵀ q_t

**Unrolling a chunk.** With ``Γ_t = g_1 + ... + g_t`` (a vector: one sum a key channel) and
the chunk's start state ``S_0``::

    S_t = diag(e^{Γ_t}) S_0 + Σ_{s <= t} diag(e^{Γ_t - Γ_s}) k_s u_sᵀ
    u_t = beta_t (v_t - (k_t ∘ e^{Γ_t})ᵀ S_0 - Σ_{s < t} (k_t · (k_s ∘ e^{Γ_t - Γ_s})) u_s)

The decay no longer factors out of the dot product: the pair ``(t, s)`` carries the
per-channel factor ``Dc_tsd = e^{Γ_td - Γ_sd}``, and the chunk's scores are contractions
over d with it::

    KK_ts = Σ_d k_td k_sd Dc_tsd,     P_ts = Σ_d q_td k_sd Dc_tsd      (s <= t; 0 above)

Otherwise the WY form is the head-decay one (:mod:`qkv.recurrent.delta.chunk`) with every
``e^{γ}`` a diagonal matrix: ``(I + A) U = diag(beta) (V - Kg S_0)``,
``A = strictly_lower(diag(beta) KK)``, ``Tinv = (I + A)⁻¹``::

    U   = Tinv diag(beta) (V - Kg S_0)               Kg = K ∘ e^{Γ}      (rows t, channels d)
    O   = scale · (Qg S_0 + P U)                     Qg = Q ∘ e^{Γ}
    S_C = diag(e^{Γ_C}) S_0 + Kcᵀ U                  Kc = K ∘ e^{Γ_C - Γ}

The chunk's transitions multiply to ``diag(e^{Γ_C}) - Kcᵀ Tinv diag(beta) Kg``.

**The factors never overflow.** ``Dc`` is formed as ``exp`` of the float64 difference
``Γ_t - Γ_s`` with ``s <= t`` only (every exponent ``<= 0``), never as
``e^{Γ_t} · e^{-Γ_s}``, which at ``g = -30`` a step overflows within three steps in float32.
That costs a ``(C, C, Dk)`` block of exps a chunk and makes ``KK``, ``P`` contractions
element by element over d (batched matrix products ``(C, C, Dk) @ (C, Dk, 2)``), so the
chunks are short: :data:`CHUNK` = 16. Time ``O(T·C·Dk + T·Dk·Dv)``, memory ``O(T·C·Dk)``
a head for the decay blocks (the heads run in groups bounded by that: :func:`work`).

**Compiled.** With the ``fast`` extra, float32's forward and backward run chunk after chunk in compiled loops
(:mod:`qkv.recurrent.delta.channels_compiled`): the decays as running products of the step decays, made in
cache, never a ``(C, C, Dk)`` block in memory; their own bits, tested against the oracle. At (1, 8, 2048, 64),
one thread, Intel Xeon model 207 (AVX-512): forward 7 ms where this path takes 157 (Kimi Linear's
``chunk_kda`` through qkv.torch: 106 ms a call, now 12), backward 33-39 where it takes 395.

**Backward.** As :mod:`qkv.recurrent.delta.backward`, the state's gradient runs back once a
chunk (``dU = scale Pᵀ dO + Kc dS_C``, ``dR = Tinvᵀ dU``,
``dS_0 = scale Qgᵀ dO + diag(e^{Γ_C}) dS_C - (beta ∘ Kg)ᵀ dR``), then, all chunks at once,
with ``W_tsd = k_sd Dc_tsd`` (the key s as it reaches t)::

    dA  = -strictly_lower(dR Uᵀ),   Gk = diag(beta) dA (the gradient of KK),   dP = scale dO Uᵀ
    dq_t = e^{Γ_t} ∘ (scale · S_0 dO_t) + Σ_s dP_ts W_ts
    dk_t = Σ_s Gk_ts W_ts + Σ_{t'} Y_{t't}
           - e^{Γ_t} ∘ (S_0 dX_t) + e^{Γ_C - Γ_t} ∘ (dS_C u_t)
    Y_tsd = Dc_tsd (Gk_ts k_td + dP_ts q_td)      dX = diag(beta) dR = dV
    dbeta_t = dR_t · X_t + Σ_s dA_ts KK_ts

**The decays' gradient**, a key channel at a time, as the sums over the steps each factor
crosses (:mod:`qkv.recurrent.crossing`), never as differences of undecayed terms: a pair
``(t, s)`` of ``KK`` or ``P`` adds ``M_tsd = Y_tsd k_sd`` to ``dg_jd`` for ``s < j <= t``;
a row of ``Qg`` (``Qg ∘ dQg``) and of ``Kg`` (``-Kg ∘ (dX S_0ᵀ)``) to ``j <= t``; a row of
``Kc`` (``Kc ∘ dKc``) to ``j > t``; ``e^{Γ_C} ∘ Σ_v dS_C ∘ S_0`` to every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import jit
from .. import crossing
from ..decay.intra import FLUSH
from .chunk_parts import LOG_FLOOR, from_chunks, to_chunks, unit_lower_inverse

CHUNK = 16   # positions a chunk (the (C, C, Dk) decay block a chunk: module docstring); the compiled
             # forward's too (one thread, (1, 8, 2048, D): 6.3-8.6 ms from C = 8 to 32 at D = 64, flat at 128)


def _tr(x):
    return np.swapaxes(x, -1, -2)


def work(T: int, C: int, Dk: int, Dv: int) -> int:
    """Numbers a head holds at once (the decay blocks and their kin): for grouping heads."""
    return T * (4 * C * Dk + C + Dk + Dv)


@dataclass
class Chunks:
    """One call's chunks, ``(B, H, N, C, ·)``, and what needs no state (module docstring)."""
    T: int
    q: np.ndarray        # (B, H, N, C, Dk)
    k: np.ndarray        # (B, H, N, C, Dk)
    v: np.ndarray        # (B, H, N, C, Dv)
    beta: np.ndarray     # (B, H, N, C)
    W: np.ndarray        # (B, H, N, C, C, Dk)  W_tsd = k_sd e^{Γ_td - Γ_sd} (s <= t; 0 above)
    Dc: np.ndarray       # (B, H, N, C, C, Dk)  e^{Γ_td - Γ_sd} (s <= t; 0 above)
    eg: np.ndarray       # (B, H, N, C, Dk)     e^{Γ_t}
    eC: np.ndarray       # (B, H, N, Dk)        e^{Γ_C}
    eCg: np.ndarray      # (B, H, N, C, Dk)     e^{Γ_C - Γ_t}
    KK: np.ndarray       # (B, H, N, C, C)
    P: np.ndarray        # (B, H, N, C, C)
    Tinv: np.ndarray     # (B, H, N, C, C)
    KQg: np.ndarray      # (B, H, N, 2C, Dk)    [Kg; Qg]
    Kc: np.ndarray       # (B, H, N, C, Dk)


def _exp(x64: np.ndarray, dtype) -> np.ndarray:
    """``exp`` of a float64 exponent (``<= 0``), rounded once to ``dtype`` (float32: below
    ``FLUSH`` is 0, as the head-decay form does)."""
    e = np.exp(x64).astype(dtype, copy=False)
    if dtype == np.float32:
        e[e < FLUSH] = 0
    return e


def prepare(q, k, v, beta, g, C: int) -> Chunks:
    """The chunked inputs and every per-chunk quantity (batched over all chunks)."""
    T, dt = q.shape[2], q.dtype
    q, k, v, beta, g = (to_chunks(x, C) for x in (q, k, v, beta, g))
    gam = np.cumsum(np.maximum(g, -LOG_FLOOR), axis=-2, dtype=np.float64)   # (B,H,N,C,Dk) Γ
    diff = gam[..., :, None, :] - gam[..., None, :, :]                      # (B,H,N,C,C,Dk) Γ_t - Γ_s
    diff[..., np.triu(np.ones((C, C), dtype=bool), 1), :] = -np.inf       # s > t: no factor
    Dc = _exp(diff, dt)
    del diff
    W = Dc * k[..., None, :, :]                                             # k_s ∘ Dc_ts
    KQ = np.stack([k, q], axis=-1)                                          # (B,H,N,C,Dk,2)
    scores = W @ KQ                                                         # (B,H,N,C,C,Dk) @ (B,H,N,C,Dk,2) -> (B,H,N,C,C,2)
    KK, P = np.ascontiguousarray(scores[..., 0]), np.ascontiguousarray(scores[..., 1])
    A = np.tril(KK, -1) * beta[..., :, None]
    Tinv = unit_lower_inverse(np.ascontiguousarray(A))
    eg, eC = _exp(gam, dt), _exp(gam[..., -1, :], dt)
    eCg = _exp(gam[..., -1:, :] - gam, dt)
    KQg = np.concatenate([k * eg, q * eg], axis=-2)                         # (B,H,N,2C,Dk)
    return Chunks(T, q, k, v, beta, W, Dc, eg, eC, eCg, KK, P, Tinv, KQg, k * eCg)


@dataclass
class Passed:
    U: np.ndarray        # (B, H, N, C, Dv) the corrections
    KS: np.ndarray       # (B, H, N, C, Dv) Kg S_0
    QS: np.ndarray       # (B, H, N, C, Dv) Qg S_0
    starts: np.ndarray   # (B, H, N, Dk, Dv) each chunk's S_0
    S: np.ndarray        # (B, H, Dk, Dv) the final state


def pass_states(ch: Chunks, S0: np.ndarray) -> Passed:
    """The state through the chunks, three products a chunk."""
    B, H, N, C, Dk = ch.k.shape
    Dv = S0.shape[-1]
    S = S0
    starts = np.empty((B, H, N, Dk, Dv), S0.dtype)
    reads = np.empty((B, H, N, 2 * C, Dv), S0.dtype)
    U = np.empty(ch.v.shape, S0.dtype)
    for n in range(N):
        starts[:, :, n] = S
        np.matmul(ch.KQg[:, :, n], S, out=reads[:, :, n])              # (B,H,2C,Dk) @ (B,H,Dk,Dv) -> (B,H,2C,Dv)
        R = ch.beta[:, :, n, :, None] * (ch.v[:, :, n] - reads[:, :, n, :C])
        np.matmul(ch.Tinv[:, :, n], R, out=U[:, :, n])                  # (B,H,C,C) @ (B,H,C,Dv) -> (B,H,C,Dv)
        S = ch.eC[:, :, n, :, None] * S + _tr(ch.Kc[:, :, n]) @ U[:, :, n]   # (B,H,Dk,C) @ (B,H,C,Dv)
    return Passed(U, reads[..., :C, :], reads[..., C:, :], starts, S)


def chunk_size(chunk, T: int) -> int:
    """Rows a chunk: the caller's ``chunk`` (None: :data:`CHUNK`), at most T, at least 1."""
    return max(1, min(CHUNK if chunk is None else int(chunk), T))


def compiled_chunk(chunk, dtype, T: int) -> int | None:
    """The chunk of the compiled forward and backward (:mod:`qkv.recurrent.delta.channels_compiled`) where they
    run: float32, numba and NumPy's ``sgemm`` found, chunks of at least 2 rows (a chunk of one row is the step
    loop, what inputs that are not finite take). Else None."""
    C = chunk_size(chunk, T)
    if np.dtype(dtype) != np.float32 or C < 2:
        return None
    mod = jit.load(jit.DELTA_CHANNELS)
    return C if mod is not None and mod.SGEMM else None


def forward(q, k, v, beta, g, initial_state, *, scale, chunk, out):
    """``S_T (B, H, Dk, Dv)`` in q's dtype, the outputs written into ``out (B, H, T, Dv)`` (C-ordered);
    ``g (B, H, T, Dk)``. ``chunk``: the NumPy path's (None: :data:`CHUNK`); float32 runs compiled
    where it can (:func:`compiled_chunk`)."""
    if (fast := compiled_chunk(chunk, q.dtype, q.shape[2])) is not None:
        return _forward_compiled(q, k, v, beta, g, initial_state, scale, fast, out)
    ch = prepare(q, k, v, beta, g, chunk_size(chunk, q.shape[2]))
    B, H, _, Dk = q.shape
    S0 = np.zeros((B, H, Dk, v.shape[-1]), q.dtype) if initial_state is None else initial_state
    run = pass_states(ch, S0)
    o = ch.P @ run.U                                                    # (B,H,N,C,C) @ (B,H,N,C,Dv) -> (B,H,N,C,Dv)
    o += run.QS
    o *= scale
    out[...] = from_chunks(o, ch.T)
    return run.S


def _forward_compiled(q, k, v, beta, g, initial_state, scale, C, out):
    B, H, T, Dk = q.shape
    Dv, n = v.shape[-1], B * H
    mod = jit.load(jit.DELTA_CHANNELS)
    S = np.zeros((n, Dk, Dv), np.float32) if initial_state is None else \
        np.array(initial_state, np.float32).reshape(n, Dk, Dv)
    o = out.reshape(n, T, Dv) if out.flags.c_contiguous else np.empty((n, T, Dv), np.float32)  # a view of out
    con = np.ascontiguousarray
    mod.forward((mod.SGEMM, int(mod.ILP64)), *(con(x).reshape(n, T, -1) for x in (q, k, v)), con(beta).reshape(n, T),
                con(g).reshape(n, T, Dk), S, o, np.float32(scale), C)
    if not out.flags.c_contiguous:
        out[...] = o.reshape(out.shape)
    return S.reshape(B, H, Dk, Dv)


def _backward_compiled(dout, dstate, q, k, v, beta, g, initial_state, scale, C):
    B, H, T, Dk = q.shape
    Dv, n, f = v.shape[-1], B * H, np.float32
    mod = jit.load(jit.DELTA_CHANNELS)
    flat = [np.ascontiguousarray(x).reshape(n, T, -1) for x in (q, k, v, g, dout)]
    S0 = np.zeros((n, Dk, Dv), f) if initial_state is None else np.ascontiguousarray(initial_state).reshape(n, Dk, Dv)
    dS = np.zeros((n, Dk, Dv), f) if dstate is None else np.array(dstate, f).reshape(n, Dk, Dv)
    grads = [np.empty(x.shape, f) for x in flat[:3]] + [np.empty((n, T), f), np.empty((n, T, Dk), f)]
    N = -(-T // C)                                                       # one head's start states, U and V - Kg S_0
    mod.backward((mod.SGEMM, int(mod.ILP64)), *flat[:3], np.ascontiguousarray(beta).reshape(n, T), flat[3], flat[4],
                 S0, dS, np.float32(scale), C, np.empty((N, Dv, Dk), f), np.empty((N, Dv, C), f), np.empty((T, Dv), f),
                 grads[0], grads[1], grads[2], grads[3], grads[4])
    dq, dk, dv, dbeta, dg = (x.reshape((B, H) + x.shape[1:]) for x in grads)
    return dq, dk, dv, dbeta, dg, None if initial_state is None else dS.reshape(B, H, Dk, Dv)


def _state_grads(ch: Chunks, dO, dS, scale):
    """Backwards over the chunks: ``(dR, ends, dS_0)``, ``ends[n]`` the gradient reaching
    chunk n's end state."""
    C = ch.k.shape[3]
    PdO = scale * (_tr(ch.P) @ dO)                                      # (B,H,N,C,C) @ (B,H,N,C,Dv) -> (B,H,N,C,Dv)
    QdO = scale * (_tr(ch.KQg[..., C:, :]) @ dO)                        # (B,H,N,Dk,C) @ (B,H,N,C,Dv) -> (B,H,N,Dk,Dv)
    Kb = ch.beta[..., None] * ch.KQg[..., :C, :]                        # diag(beta) Kg
    ends = np.empty(QdO.shape, dO.dtype)
    dR = np.empty_like(PdO)
    N = dO.shape[2]
    for n in reversed(range(N)):
        ends[:, :, n] = dS
        dU = PdO[:, :, n] + ch.Kc[:, :, n] @ dS                         # (B,H,C,Dk) @ (B,H,Dk,Dv) -> (B,H,C,Dv)
        np.matmul(_tr(ch.Tinv[:, :, n]), dU, out=dR[:, :, n])          # (B,H,C,C) @ (B,H,C,Dv) -> (B,H,C,Dv)
        dS = QdO[:, :, n] + ch.eC[:, :, n, :, None] * dS - _tr(Kb[:, :, n]) @ dR[:, :, n]  # (B,H,Dk,C) @ (B,H,C,Dv)
    return dR, ends, dS


def _decay_grad(ch: Chunks, M, after, before, ends, starts):
    """``dg (B, H, N, C, Dk)``: each term summed over the steps its factor crosses."""
    f64 = np.float64
    whole = ch.eC.astype(f64) * (ends * starts).sum(-1, dtype=f64)      # (B,H,N,Dk) e^{Γ_C} S_0: every step
    dg = crossing.later(after.astype(f64), -2) + crossing.earlier(before.astype(f64), -2) + whole[..., None, :]
    dg += np.moveaxis(crossing.crossing(np.moveaxis(M.astype(f64), -1, -3)), -2, -1)   # pairs s < j <= t
    return dg


def backward(dout, dstate, q, k, v, beta, g, initial_state, *, scale, chunk):
    """``(dq, dk, dv, dbeta, dg, dinitial_state)`` of :func:`forward` in q's dtype
    (``dinitial_state`` None without ``initial_state``). ``chunk`` as :func:`forward`'s."""
    if (fast := compiled_chunk(chunk, q.dtype, q.shape[2])) is not None:
        return _backward_compiled(dout, dstate, q, k, v, beta, g, initial_state, scale, fast)
    C, dt = chunk_size(chunk, q.shape[2]), q.dtype
    ch = prepare(q, k, v, beta, g, C)
    B, H, _, Dk = q.shape
    zeros = np.zeros((B, H, Dk, v.shape[-1]), dt)
    run = pass_states(ch, zeros if initial_state is None else initial_state)
    dO = to_chunks(dout, C)
    dR, ends, dS0 = _state_grads(ch, dO, zeros if dstate is None else dstate, scale)
    U, starts = run.U, run.starts
    strict = np.tril(np.ones((C, C), dtype=bool), -1)
    lower = np.tril(np.ones((C, C), dtype=bool))
    dX = ch.beta[..., None] * dR                                        # = dV
    dA = np.where(strict, -(dR @ _tr(U)), 0)                            # (B,H,N,C,Dv) @ (B,H,N,Dv,C) -> (B,H,N,C,C)
    Gk = ch.beta[..., None] * dA                                        # the gradient of KK
    dbeta = (dR * (ch.v - run.KS)).sum(-1) + (dA * ch.KK).sum(-1)
    dP = np.where(lower, scale * (dO @ _tr(U)), 0)                      # (B,H,N,C,Dv) @ (B,H,N,Dv,C) -> (B,H,N,C,C)
    GP = np.stack([Gk, dP], axis=-2)                                    # (B,H,N,C,2,C)
    through_W = GP @ ch.W                                               # (B,H,N,C,2,C) @ (B,H,N,C,C,Dk) -> (B,H,N,C,2,Dk)
    Y = ch.Dc * (Gk[..., None] * ch.k[..., :, None, :] + dP[..., None] * ch.q[..., :, None, :])  # (B,H,N,C,C,Dk)
    dQg = scale * (dO @ _tr(starts))                                    # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dKg = -(dX @ _tr(starts))                                           # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dKc = U @ _tr(ends)                                                 # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dq = ch.eg * dQg + through_W[..., 1, :]
    dk = ch.eg * dKg + ch.eCg * dKc + through_W[..., 0, :] + Y.sum(-3)
    Qg, Kg = ch.KQg[..., C:, :], ch.KQg[..., :C, :]
    dg = _decay_grad(ch, Y * ch.k[..., None, :, :], Qg * dQg + Kg * dKg, ch.Kc * dKc, ends, starts)
    T = ch.T
    return (from_chunks(dq, T), from_chunks(dk, T), from_chunks(dX, T), from_chunks(dbeta, T),
            from_chunks(dg, T).astype(dt, copy=False), None if initial_state is None else dS0)
