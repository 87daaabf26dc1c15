"""The chunked dplr backward: reverse mode through the three passes of :mod:`qkv.recurrent.generalized_delta.chunk`.

Redo passes (a) and (b), keeping the chunk-entry states ``S_in`` (``N·Dk·Dv`` numbers a head,
not a state a step) and, up to :data:`KEEP_BYTES`, the groups' pass (a); then, a group of chunks
at a time from the last, from what was kept (a group's pass (a) made again where it was not). Then, with ``dO = scale · dout`` and ``Qe = qt + A_qb W``::

    (b') the state backwards, one product a chunk, from dS_out[N-1] = dstate:
         dS_in[n] = Qeᵀ dO + Mᵀ dS_out[n],     dS_out[n-1] = dS_in[n],     dS_0 = dS_in[0]

and every chunk at once (each line the derivative of one forward line, ``u = U + W S_in``)::

    o = A_qk v + A_qb u + qt S_in:      dA_qk = dO vᵀ,  dA_qb = dO uᵀ,  dv = A_qkᵀ dO,
                                        du = A_qbᵀ dO,  dqt = dO S_inᵀ,  dW = du S_inᵀ
    S_out = M S_in + Hc:                dM = dS_out S_inᵀ,  dHc = dS_out
    M = diag(eC) + btᵀ W:               deC = diag(dM),  dbt = W dMᵀ,  dW += bt dM
    Hc = ktᵀ v + btᵀ U:                 dkt = v dHcᵀ,  dv += kt dHc,  dbt += U dHcᵀ,  dU = du + bt dHc
    U = P A_ak v, W = P at:             dRv = Pᵀ dU,  dRa = Pᵀ dW,  dat = dRa,
                                        dA_ak = dRv vᵀ,  dv += A_akᵀ dRv,
                                        dA_ab = dRv Uᵀ + dRa Wᵀ     (from d(L⁻¹) = -L⁻¹ dL L⁻¹)

(masked to the products' triangles by :func:`qkv.recurrent.generalized_delta.scores.scores_backward`, which
also gives the products' own ``dq, da, dk, db`` and their part of the decays' gradient).

**The decays' gradient.** Every decay factor is ``exp`` of a sum of the steps' ``g`` over a
range of steps: the factor's gradient reaches ``dg_j`` for each step ``j`` it spans::

    qt_t = q_t ∘ exp G_t             spans j <= t           through  qt ∘ dqt
    at_t = a_t ∘ exp G_{t-1}         spans j <= t - 1                at ∘ dat
    kt_t = k_t ∘ exp(G_C - G_t)      spans j > t                     kt ∘ dkt  (bt alike)
    eC = exp G_C                     spans every j                   eC ∘ deC
    A[t, s]                          spans s < j <= tx               the scores' (3)

so, with ``dg^A`` the products' part (:mod:`.scores`, summed pair by pair)::

    dg_j = Σ_{t >= j} qt ∘ dqt + Σ_{t > j} at ∘ dat + Σ_{t < j} (kt ∘ dkt + bt ∘ dbt)
           + eC ∘ deC + dg^A_j                                                           (4)

(summed over the channels for one decay a head). Every term of (4) carries the decay of
step j: where the decays are steep, dg is small and so is each term. The same sum written
through ``G`` (``dG_t = qt ∘ dqt - kt ∘ dkt + …``, then a reverse running sum, with
``Σ_t kt ∘ dkt`` added at ``G_C``) cancels O(1) terms (``kt_C = k_C``) down to that small
answer and leaves float64's rounding of them: 1e-3 of dg at ``g = -30`` a step.

**float32 with the fast extra** (:mod:`.compiled`): (b') and the chunks' lines above in one
compiled sweep a group (``chunk_grads``, through ``M``'s structure, no ``dM``), and with a decay
a channel the products' backward too (``scores_backward``, every pair exactly); other sums than
this NumPy path's, so other bits (tested against the float64 oracle). float64 and ``QKV_JIT=0``
take the NumPy path.
"""
from __future__ import annotations

import numpy as np

from ... import jit, threads
from .chunk_parts import Chunks, from_chunks, groups, prepare, states, to_chunks
from .scores import running_sum, scores_backward

KEEP_BYTES = 1 << 28   # pass (a) kept for the backward sweep, at most (the rest made again)


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _state_backward(ch: Chunks, Qe, dO, S_in, dstate):
    """``(dS_out (B, H, N, Dk, Dv), dS_0)``: pass (b') of the module docstring."""
    B, H, N, Dk, Dv = S_in.shape
    X = _swap(Qe) @ dO                                                 # (…,Dk,C) @ (…,C,Dv) -> (…,Dk,Dv)
    dS = np.zeros((B, H, Dk, Dv), dO.dtype) if dstate is None else dstate.astype(dO.dtype)
    dS_out = np.empty_like(S_in)
    for n in reversed(range(N)):
        dS_out[:, :, n] = dS
        dS = X[:, :, n] + _swap(ch.M[:, :, n]) @ dS                    # (B,H,Dk,Dk) @ (B,H,Dk,Dv)
    return dS_out, dS


def _chunk_grads(ch: Chunks, dO, S_in, dS_out):
    """Every chunk's ``dA (…, 2, 2, C, C)``, ``dv`` and the factor gradients ``dqt, dat, dkt, dbt, deC``."""
    A_qk, A_qb, A_ak = ch.A[..., 0, 0, :, :], ch.A[..., 0, 1, :, :], ch.A[..., 1, 0, :, :]
    u = ch.U + ch.W @ S_in                                             # (…,C,Dk) @ (…,Dk,Dv) -> (…,C,Dv)
    dA = np.empty_like(ch.A)
    dA[..., 0, 0, :, :] = dO @ _swap(ch.v)                             # (…,C,Dv) @ (…,Dv,C) -> (…,C,C)
    dA[..., 0, 1, :, :] = dO @ _swap(u)
    du = _swap(A_qb) @ dO                                              # (…,C,C) @ (…,C,Dv) -> (…,C,Dv)
    dqt = dO @ _swap(S_in)                                             # (…,C,Dv) @ (…,Dv,Dk) -> (…,C,Dk)
    dM = dS_out @ _swap(S_in)                                          # (…,Dk,Dv) @ (…,Dv,Dk) -> (…,Dk,Dk)
    deC = np.einsum("...ii->...i", dM)
    dW = du @ _swap(S_in) + ch.bt @ dM                                 # (…,C,Dk) @ (…,Dk,Dk)
    dbt = ch.W @ _swap(dM) + ch.U @ _swap(dS_out)                      # (…,C,Dv) @ (…,Dv,Dk) -> (…,C,Dk)
    dkt = ch.v @ _swap(dS_out)
    dU = du + ch.bt @ dS_out                                           # (…,C,Dk) @ (…,Dk,Dv) -> (…,C,Dv)
    PT = _swap(ch.P)
    dRv, dat = PT @ dU, PT @ dW                                        # (…,C,C) @ (…,C,·)
    dA[..., 1, 0, :, :] = dRv @ _swap(ch.v)
    dA[..., 1, 1, :, :] = dRv @ _swap(ch.U) + dat @ _swap(ch.W)
    dv = _swap(A_qk) @ dO + ch.kt @ dS_out + _swap(A_ak) @ dRv        # (…,C,C) @ (…,C,Dv), (…,C,Dk) @ (…,Dk,Dv)
    return dA, dv, dqt, dat, dkt, dbt, deC


def _decay_grad(ch: Chunks, dg_products, factors):
    """``dg (…, C[, Dk])``: (4) of the module docstring, from the products' part and the
    factors' ``(scaled, grad)`` pairs."""
    red = (lambda x: x.sum(-1, keepdims=True)) if ch.per_head else (lambda x: x)
    (qt, dqt), (at, dat), (kt, dkt), (bt, dbt), (eC, deC) = factors
    later = red(qt * dqt)                                               # (…,C,Dk or 1): steps j <= t
    later[..., :-1, :] += red(at[..., 1:, :] * dat[..., 1:, :])         # steps j <= t - 1
    earlier = red(kt * dkt + bt * dbt)                                  # steps j > t
    dg = running_sum(later, reverse=True) + running_sum(earlier, exclusive=True)
    dg += red(eC * deC)[..., None, :]
    return dg[..., 0] + dg_products if ch.per_head else dg + dg_products


def _compiled_states(mod, ch: Chunks, S):
    """:func:`states` compiled (float32, through ``M``'s structure): ``((S_in, W S_in), S_out)``."""
    c = np.ascontiguousarray
    S = np.array(S, np.float32, order="C")
    S_in, WS = np.empty(ch.Hc.shape, np.float32), np.empty(ch.U.shape, np.float32)
    eC = c(np.broadcast_to(ch.eC, ch.W.shape[:-2] + ch.W.shape[-1:]))
    mod.states((mod.SGEMM, int(mod.ILP64)), c(ch.W), c(ch.bt), eC, c(ch.Hc), S, S_in, WS)
    return (S_in, WS), S


def _compiled_chunk_grads(mod, ch: Chunks, dO, entry, dS_end):
    """:func:`_state_backward` and :func:`_chunk_grads` in one compiled sweep (float32,
    ``compiled.chunk_grads``: other sums, other bits) from ``entry = (S_in, W S_in)``:
    ``(dA, dv, dqt, dat, dkt, dbt, deC)``, dS_start."""
    S_in, WS = entry
    c = np.ascontiguousarray
    f = np.float32
    dA = np.empty(ch.A.shape, f)
    dv, dqt, dat, dkt, dbt = np.empty(ch.U.shape, f), *(np.empty(ch.W.shape, f) for _ in range(4))
    deC = np.empty(ch.W.shape[:-2] + ch.W.shape[-1:], f)
    dS = np.array(dS_end, f, order="C")
    eC = c(np.broadcast_to(ch.eC, deC.shape))
    mod.chunk_grads((mod.SGEMM, int(mod.ILP64)), *(c(x) for x in (ch.A, ch.P, ch.v, ch.U, WS, ch.W, ch.qt, ch.kt, ch.bt)),
                    eC, S_in, c(dO), dS, dA, dv, dqt, dat, dkt, dbt, deC, threads.small_products())
    return (dA, dv, dqt, dat, dkt, dbt, deC), dS


def _compiled(dtype, Dk: int, Dv: int):
    """The compiled module where :func:`_compiled_chunk_grads` runs (float32, the ``fast`` extra
    with an ``sgemm``), else None."""
    mod = jit.load(jit.DPLR) if dtype == np.float32 and min(Dk, Dv) > 1 else None
    return mod if mod is not None and mod.SGEMM else None


def _group_grads(ch: Chunks, dO, S_in, dS_end, mod=None):
    """One group's ``(dq, dk, dv, da, db, dg)`` (chunked) and the gradient at its start."""
    if mod is not None:
        (dA, dv, dqt, dat, dkt, dbt, deC), dS_start = _compiled_chunk_grads(mod, ch, dO, S_in, dS_end)
    else:
        Qe = ch.qt + ch.A[..., 0, 1, :, :] @ ch.W                      # (…,C,C) @ (…,C,Dk) -> (…,C,Dk)
        dS_out, dS_start = _state_backward(ch, Qe, dO, S_in, dS_end)
        dA, dv, dqt, dat, dkt, dbt, deC = _chunk_grads(ch, dO, S_in, dS_out)
    if mod is not None and not ch.per_head:
        dX, dY, dg_products = np.empty_like(ch.X), np.empty_like(ch.Y), np.empty_like(ch.e)
        mod.scores_backward(dA, ch.X, ch.Y, np.ascontiguousarray(ch.e), dX, dY, dg_products)
    else:
        dX, dY, dg_products = scores_backward(dA, ch.X, ch.Y, ch.D, ch.e, ch.A)
    dq = dX[..., 0, :, :] + dqt * ch.fG
    da = dX[..., 1, :, :] + dat * ch.fGex
    dk = dY[..., 0, :, :] + dkt * ch.end
    db = dY[..., 1, :, :] + dbt * ch.end
    dg = _decay_grad(ch, dg_products, [(ch.qt, dqt), (ch.at, dat), (ch.kt, dkt), (ch.bt, dbt), (ch.eC, deC)])
    return (dq, dk, dv, da, db, dg), dS_start


def _nbytes(ch: Chunks) -> int:
    return sum(x.nbytes for x in vars(ch).values() if isinstance(x, np.ndarray))


def backward(dout, dstate, q, k, v, a, b, g, *, scale, initial_state=None, chunk):
    """``(dq, dk, dv, da, db, dg, dinitial_state)`` in q's dtype, chunks of ``chunk`` steps.

    A group of chunks at a time (:func:`qkv.recurrent.generalized_delta.chunk_parts.groups`): forwards,
    keeping every group's chunk-entry states ``S_in`` (the compiled path: ``(S_in, W S_in)``, no
    ``M``) and the last groups' pass (a) (their :class:`Chunks`, less ``Hc``, at most
    :data:`KEEP_BYTES`); then backwards, the other groups' pass (a) made again: the same
    arithmetic, so the same bits whichever groups were kept.
    """
    B, H, T, Dk = q.shape
    dtype = q.dtype
    inputs = (q, k, v, a, b, g)
    parts = groups(T, chunk, B * H, Dk)
    S = np.zeros((B, H, Dk, v.shape[-1]), dtype) if initial_state is None else initial_state.astype(dtype)
    kept, first_kept = [], len(parts)
    mod = _compiled(dtype, Dk, v.shape[-1])
    make = lambda part: prepare(*(x[:, :, part] for x in inputs), chunk, transition=mod is None)  # noqa: E731
    for i, part in enumerate(parts):
        ch = make(part)
        S_in, S = states(ch, S) if mod is None else _compiled_states(mod, ch, S)
        ch.Hc = None                                                   # read by states() only
        if i == 0:
            first_kept = len(parts) - KEEP_BYTES // max(1, _nbytes(ch))
        kept.append((ch if i >= first_kept else None, S_in))
    grads = [np.empty(x.shape, dtype) for x in inputs]
    dS = np.zeros_like(S) if dstate is None else dstate.astype(dtype)
    for part in reversed(parts):
        ch, S_in = kept.pop()
        ch = make(part) if ch is None else ch
        dO = to_chunks(dout[:, :, part].astype(dtype, copy=False), chunk) * dtype.type(scale)
        chunk_grads, dS = _group_grads(ch, dO, S_in, dS, mod)
        for out, x in zip(grads, chunk_grads):
            out[:, :, part] = from_chunks(x, part.stop - part.start)
    return (*grads, dS)
