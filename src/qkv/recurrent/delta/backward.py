"""The chunked delta rule's backward (the forward and its names: :mod:`qkv.recurrent.delta.chunk`).

A chunk maps its start state ``S_0`` and its inputs to its outputs and end state::

    X   = V - diag(e^γ) K S_0                   the residuals before the write strength
    U   = Tinv diag(beta) X
    O   = scale · (Qg S_0 + P U)                 Qg = diag(e^γ) Q,   P = (Q Kᵀ) ∘ D
    S_C = e^{γ_C} S_0 + Kcᵀ U                    Kc = diag(e^{γ_C - γ}) K

**The state's gradient, chunk by chunk backwards.** With ``dO`` and ``dS_C`` (the gradient
reaching the chunk's end state: ``dstate`` for the last chunk)::

    dU   = scale · Pᵀ dO + Kc dS_C               (C, Dv)
    dR   = Tinvᵀ dU                              R = diag(beta) X,  U = Tinv R
    dX   = diag(beta) dR
    dS_0 = scale · Qgᵀ dO + e^{γ_C} dS_C - Kᵀ diag(e^γ) dX
         = scale · Qgᵀ dO + e^{γ_C} dS_C - Kbᵀ dR       Kb = diag(beta e^γ) K

The terms without ``dS_C`` (``scale · Pᵀ dO``, ``scale · Qgᵀ dO``) are batched over all
chunks before the loop; the loop then costs three products a chunk, the forward's pass in
reverse (``Kc_n dS`` (C,Dk) @ (Dk,Dv), ``Tinv_nᵀ dU_n`` (C,C) @ (C,Dv), ``Kb_nᵀ dR_n``
(Dk,C) @ (C,Dv)), and keeps each chunk's ``dR`` and ``dS_C`` (``(T/C)·Dk·Dv``). The chunk
start states ``S_0`` come from the forward's state pass, run again
(:func:`qkv.recurrent.delta.chunk_parts.pass_states` with ``keep``).

**The inputs' gradients**, all chunks at once, from ``dR``, ``dX``, ``U``, ``S_0``, ``dS_C``:

* through the triangular solve: ``dA = -strictly_lower(dR Uᵀ)`` (``dL = -L⁻ᵀ dU Uᵀ``);
* through ``A = beta_t (K Kᵀ) ∘ D`` (strict): ``G = dA ∘ beta_t D`` gives
  ``dK += (G + Gᵀ) K``, ``dbeta_t += Σ_s dA_ts (k_t·k_s) D_ts``;
* through ``P``: ``dP = scale · dO Uᵀ``, ``dQ += (dP ∘ D) K``, ``dK += (dP ∘ D)ᵀ Q``;
* through the reads of ``S_0``: ``dQ += diag(e^γ) scale · dO S_0ᵀ``,
  ``dK -= diag(e^γ) dX S_0ᵀ``;
* through ``Kc``: ``dK += diag(e^{γ_C - γ}) U dS_Cᵀ``;
* ``dV = dX``, ``dbeta_t += dR_t · X_t``.

**The decay.** Every decay factor is ``e^{γ_a - γ_b}`` of some cumulative ``γ``; a factor
``f = e^{γ_a - γ_b}`` multiplying ``x`` with upstream gradient ``dx'`` adds ``x·dx'·f`` to
``dγ_a`` and takes it from ``dγ_b``. Collected: ``E = dA ∘ A`` and ``F = dP ∘ P`` add
``rowsum - colsum``; ``Qg`` adds ``rowsum(dQg ∘ Qg)``; ``X`` adds ``-rowsum(dX ∘ e^γ K S_0)``;
``Kc`` adds ``-rowsum(dKc ∘ Kc)`` to each ``t`` and its total to ``γ_C``; ``e^{γ_C} S_0`` adds
``e^{γ_C} Σ dS_C ∘ S_0`` to ``γ_C``. Then ``dg_i = Σ_{t >= i} dγ_t`` within the chunk
(``γ_t`` sums ``g_1..g_t``). That sum is taken term by term over the steps each factor
crosses (:mod:`qkv.recurrent.crossing`): a pair ``(t, s)`` of E or F adds to ``dg_i`` for
``s < i <= t``, a row of ``Qg`` or of ``X`` for ``i <= t``, a row of ``Kc`` for ``i > t``,
``e^{γ_C} S_0`` to all; written as rowsum - colsum and a reversed sum, the undecayed terms
(F's diagonal, the chunk's last ``Kc`` row) would enter twice and cancel, leaving their
rounding far above the true ``dg`` at steep decays. Without a decay (DeltaNet) none of this
is computed.

**float32, compiled** (the ``fast`` extra: :func:`_compiled_grads`). Two sweeps over the chunks,
each chunk's work done while its blocks are in cache, ``sgemm`` called from the loop:
``compiled.backward_states`` forwards (the scores ``[K Kᵀ; Q Kᵀ]``, ``D``, ``Tinv`` and the state
pass, keeping ``S_0``, ``U`` and ``Kg S_0``: no ``Q S_0``, whose one use, the decay's
``rowsum(dQg ∘ Qg)``, reads ``dQg``), then ``compiled.backward_chunks`` backwards, with the
products that share an operand stacked: ``[Qg; -Kb]ᵀ [scale dO; dR]`` for ``dS_0``,
``[scale dO; dR] S_0ᵀ`` (``dQg`` and the reads' ``dK``) and ``[scale dO; dR] Uᵀ`` (``dP`` and
``dA``). Its chunk is :data:`COMPILED_CHUNK` = 32 where the caller gives none: the state's
products (``Dk·Dv`` a row, 8 of them against the forward's 3) do not grow with C, the in-chunk
ones do: at (1, 8, 2048, D) float32, one thread, C = 32 took 10% (D = 128) and 25% (D = 64)
less time than 64, and 16 4-7% more than 32. Its bits are not the NumPy path's (float32 sums
in other orders: up to 6e-7 of a gradient's largest entry apart, each as close to float64 as
the NumPy path's within 2.6x); float64, and float32 without numba, run the NumPy path.

Cost: the forward's products again, plus about twice as many of the same shapes; memory as
the forward's plus the ``(T/C)·Dk·Dv`` chunk start states.
"""
from __future__ import annotations

import numpy as np

from ... import jit, threads
from .. import crossing
from .chunk_parts import CHUNK, Chunks, cumulative, decays, from_chunks, pass_states, prepare, to_chunks


COMPILED_CHUNK = 32  # the compiled backward's chunk when the caller gives none (measured: module docstring)


def _tr(x):
    return np.swapaxes(x, -1, -2)


def _state_grads(ch: Chunks, dO, dS, scale):
    """Backwards over the chunks: ``(dR (B,H,N,C,Dv), ends (B,H,N,Dk,Dv), dS_0)``, ``ends[n]``
    the gradient reaching chunk n's end state, ``dS`` the one reaching the last (dstate)."""
    B, H, N, C, Dk = ch.k.shape
    PdO = scale * (_tr(ch.P) @ dO)                                  # (B,H,N,C,C) @ (B,H,N,C,Dv) -> (B,H,N,C,Dv)
    QdO = scale * (_tr(ch.q) @ (ch.eg[..., None] * dO if ch.gated else dO))  # (B,H,N,Dk,C) @ (B,H,N,C,Dv)
    Kb = (ch.beta * ch.eg)[..., None] * ch.k                        # diag(beta e^γ) K
    ends = np.empty(QdO.shape, dtype=dO.dtype)
    dR = np.empty_like(PdO)
    for n in reversed(range(N)):
        ends[:, :, n] = dS
        dU = PdO[:, :, n] + ch.Kc[:, :, n] @ dS                     # (B,H,C,Dk) @ (B,H,Dk,Dv) -> (B,H,C,Dv)
        np.matmul(_tr(ch.Tinv[:, :, n]), dU, out=dR[:, :, n])      # (B,H,C,C) @ (B,H,C,Dv) -> (B,H,C,Dv)
        dS = QdO[:, :, n] + ch.eC[:, :, n, None, None] * dS - _tr(Kb[:, :, n]) @ dR[:, :, n]  # (B,H,Dk,C) @ (B,H,C,Dv)
    return dR, ends, dS


def _decay_grad(ch: Chunks, M, readQ, dX, KS, dKc, ends, starts):
    """``dg (B, H, N, C)`` from the factors ``e^{γ_a - γ_b}`` (the module docstring), each term
    summed over the steps its factor crosses (:mod:`qkv.recurrent.crossing`: no two terms of
    an undecayed size cancel); ``M = dA ∘ A + dP ∘ P`` the pairs, ``readQ = scale · dO ∘ Qg S_0``."""
    f64 = np.float64
    after = (readQ.sum(-1) - (dX * KS).sum(-1)).astype(f64)             # e^{γ_t} on row t: Σ_{t >= i}
    before = (dKc * ch.Kc).sum(-1, dtype=f64)                          # e^{γ_C - γ_t} on row t: Σ_{t < i}
    whole = ch.eC * (ends * starts).sum((-1, -2), dtype=f64)          # e^{γ_C} S_0: every step
    dg = crossing.later(after, -1) + crossing.earlier(before, -1) + whole[..., None]
    dg += crossing.crossing(M)                                         # pairs s < i <= t
    return dg.astype(M.dtype, copy=False)


def _compiled(dtype, C: int, Dk: int, Dv: int):
    """The compiled module where :func:`_compiled_grads` runs (float32, the ``fast`` extra with an
    ``sgemm``, no size below 2), else None."""
    mod = jit.load(jit.DELTA) if dtype == np.float32 and min(C, Dk, Dv) > 1 else None
    return mod if mod is not None and mod.SGEMM else None


def chunk_size(chunk, dtype, T: int, Dk: int, Dv: int) -> int:
    """The backward's chunk: the caller's, else :data:`COMPILED_CHUNK` where the compiled pass runs,
    else :data:`CHUNK` (the forward's); at most T."""
    if chunk is None:
        chunk = COMPILED_CHUNK if _compiled(np.dtype(dtype), COMPILED_CHUNK, Dk, Dv) is not None else CHUNK
    return max(1, min(chunk, T))


def backward(dout, dstate, q, k, v, beta, g=None, *, scale, initial_state=None, chunk=None, out=None):
    """``(dq, dk, dv, dbeta, dg, dinitial_state)`` of :func:`qkv.recurrent.delta.chunk.forward`, in q's
    dtype (``dg`` None without ``g``, ``dinitial_state`` None without ``initial_state``); ``out``:
    ``(dq, dk, dv, dbeta, dg or None)`` to write them into (the compiled pass writes in place)."""
    B, H, T, Dk = q.shape
    C = chunk_size(chunk, q.dtype, T, Dk, v.shape[-1])
    S0 = np.zeros((B, H, Dk, v.shape[-1]), q.dtype) if initial_state is None else np.array(initial_state, q.dtype)
    dS = np.zeros_like(S0) if dstate is None else np.array(dstate, q.dtype)
    out = empty_grads(q, k, v, beta, g) if out is None else out
    into = [None if x is None else _chunked(x, C) for x in out]     # views where T is a multiple of C
    mod = _compiled(q.dtype, C, Dk, v.shape[-1])
    if mod is not None:
        grads = _compiled_grads(mod, q, k, v, beta, g, S0, dout, dS, scale, C, into)
    else:
        ch = prepare(q, k, v, beta, g, C)
        grads = _grads(ch, pass_states(ch, S0, keep=True), to_chunks(dout, C), dS, scale)
    for x, got in zip(out, grads):
        if x is not None and not np.may_share_memory(x, got):
            np.copyto(x, from_chunks(got, T))
    return tuple(out) + (None if initial_state is None else grads[-1],)


def empty_grads(q, k, v, beta, g) -> list:
    """``[dq, dk, dv, dbeta, dg or None]`` to be written, in q's dtype."""
    return [np.empty(x.shape, q.dtype) for x in (q, k, v, beta)] + [None if g is None else np.empty(beta.shape, q.dtype)]


def _chunked(x, C: int):
    """``x (B, H, T, ...)`` as chunks ``(B, H, T/C, C, ...)``, a view where C divides T, else a new array."""
    B, H, T = x.shape[:3]
    if T % C == 0 and x.flags.c_contiguous:
        return x.reshape((B, H, T // C, C) + x.shape[3:])
    return np.empty((B, H, -(-T // C), C) + x.shape[3:], x.dtype)


def _compiled_grads(mod, q, k, v, beta, g, S0, dout, dS, scale, C: int, into):
    """:func:`prepare`, :func:`pass_states` and :func:`_grads` in two compiled sweeps over the chunks,
    float32 (``compiled.backward_states`` forwards, ``compiled.backward_chunks`` backwards, the
    gradients written into ``into``, the chunked ``dq, dk, dv, dbeta, dg or None``): the same
    products, each chunk's while it is in cache; other bits than the NumPy path's."""
    f, c = np.float32, np.ascontiguousarray
    kc, qc, vc, bc, dO = (c(to_chunks(x, C)) for x in (k, q, v, beta, dout))
    B, H, N, _, Dk = kc.shape
    gamma = cumulative(None if g is None else to_chunks(g, C))
    eg, eC, eCg = decays(gamma, bc.shape, f)
    scores = np.empty((B, H, N, 2 * C, C), f)                       # [K Kᵀ; P] a chunk
    D, Tinv = np.empty((B, H, N, C, C), f), np.empty((B, H, N, C, C), f)
    Dv = vc.shape[-1]
    KS, Ut, starts = np.empty(vc.shape, f), np.empty((B, H, N, Dv, C), f), np.empty((B, H, N, Dk, Dv), f)
    addr = (mod.SGEMM, int(mod.ILP64))
    mod.backward_states(addr, kc, qc, vc, bc, g is not None, np.zeros(bc.shape) if gamma is None else gamma, eg, eC,
                        eCg, np.array(S0, f, order="C"), scores, D, Tinv, KS, Ut, starts)
    dq, dk, dv, dbeta, dg = into
    dS = np.array(dS, f, order="C")
    mod.backward_chunks(addr, kc, qc, vc, bc, eg, eC, eCg, Tinv, scores, D, Ut, KS, starts, dO, f(scale), g is not None,
                        dS, dq, dk, dv, dbeta, dbeta if dg is None else dg, threads.small_products())
    return dq, dk, dv, dbeta, dg, dS


def _grads(ch: Chunks, run, dO, dS, scale):
    """``(dq, dk, dv, dbeta, dg or None)`` in chunks and ``dS_0``, from the state pass ``run``
    (``keep``) and ``dS`` the gradient reaching the final state (the module docstring)."""
    C = ch.k.shape[-2]
    dR, ends, dS0 = _state_grads(ch, dO, dS, scale)
    starts, U = run.starts, run.U
    dX = ch.beta[..., None] * dR                                    # = dV
    strict = np.tril(np.ones((C, C), dtype=bool), -1)
    dAD = np.where(strict, -(dR @ _tr(U)), 0) * ch.D                # (B,H,N,C,Dv) @ (B,H,N,Dv,C) -> (B,H,N,C,C)
    G = ch.beta[..., None] * dAD                                    # dL/d(K Kᵀ), strictly lower
    dbeta = (dR * (ch.v - run.KS)).sum(-1) + (dAD * ch.KK).sum(-1)
    dP = scale * (dO @ _tr(U))                                      # (B,H,N,C,Dv) @ (B,H,N,Dv,C) -> (B,H,N,C,C)
    dPD = dP * ch.D
    dQg = scale * (dO @ _tr(starts))                                # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dq = dPD @ ch.k + ch.eg[..., None] * dQg                        # (B,H,N,C,C) @ (B,H,N,C,Dk) -> (B,H,N,C,Dk)
    dKc = U @ _tr(ends)                                             # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dk = _tr(dPD) @ ch.q + (G + _tr(G)) @ ch.k                      # (B,H,N,C,C) @ (B,H,N,C,Dk) -> (B,H,N,C,Dk)
    dk -= (ch.eg[..., None] * dX) @ _tr(starts)                     # (B,H,N,C,Dv) @ (B,H,N,Dv,Dk) -> (B,H,N,C,Dk)
    dk += ch.eCg[..., None] * dKc if ch.gated else dKc
    dg = None
    if ch.gated:
        dg = _decay_grad(ch, G * ch.KK + dP * ch.P, scale * dO * run.QS, dX, run.KS, dKc, ends, starts)
    return dq, dk, dX, dbeta, dg, dS0
