"""The dplr recurrence (RWKV-7's generalized delta rule) in chunks: O(T·C·Dk + T·Dk·Dv) time.

Each (batch, head) keeps a state ``S (Dk, Dv)``::

    S_t = (diag(e_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ,     e_t = exp(g_t),     o_t = scale · S_tᵀ q_t

the step oracle :func:`qkv.recurrent.generalized_delta.naive.dplr_forward` (flash-linear-attention's
``dplr_recurrence`` with ``alpha = a``, ``beta = b``, ``gk = g``). Stepping it costs a
``Dk·Dv`` update a step, one step at a time; the chunked form does the same work with
matrix products over C steps at once (as fla's ``chunk_dplr``).

**Inside a chunk.** Number the chunk's steps ``t = 1..C``, let ``S_0`` be the state entering
it and ``G_t = g_1 + ... + g_t`` (per channel; ``G_0 = 0``). Name what ``a`` reads,
``u_t = S_{t-1}ᵀ a_t`` (Dv). Then every step adds two rank-1 terms to a decayed state,
``S_t = diag(e_t) S_{t-1} + k_t v_tᵀ + b_t u_tᵀ``, and unrolled::

    S_t = diag(exp G_t) S_0 + Σ_{s <= t} diag(exp(G_t - G_s)) (k_s v_sᵀ + b_s u_sᵀ)      (1)

Reading (1) at ``t - 1`` with ``a_t`` gives the u's a triangular system::

    u_t = Σ_{s < t} A_ak[t,s] v_s + A_ab[t,s] u_s + S_0ᵀ at_t
    A_xy[t,s] = Σ_i x_t[i] y_s[i] exp(Gx_t[i] - G_s[i])        (Gx = G for q, G_{t-1} for a)

with ``at_t = a_t ∘ exp(G_{t-1})``. As matrices over the chunk, ``(I - A_ab) u = A_ak v + at S_0``,
and with ``P = (I - A_ab)^{-1}`` (unit lower triangular: a substitution, no pivots)::

    u = U + W S_0,       U = P A_ak v  (C, Dv),       W = P at  (C, Dk)                    (2)

``W`` is the WY-like form of the chunk's product of rank-1-plus-diagonal transitions: the
transition over the whole chunk is ``S_C = M S_0 + Hc`` with, from (1) at ``t = C``,

    M  = diag(exp G_C) + btᵀ W               (Dk, Dk),   bt = b ∘ exp(G_C - G), kt likewise
    Hc = ktᵀ v + btᵀ U                       (Dk, Dv)

and the outputs, from (1) read by ``q_t``::

    o / scale = A_qk v + A_qb u + qt S_0 = A_qk v + A_qb U + (qt + A_qb W) S_0,    qt = q ∘ exp G

**Three passes.** (a) Every chunk at once: the masked decayed products A
(:mod:`qkv.recurrent.generalized_delta.scores`, which never forms ``exp(-G)``: for per-channel decays the
products are split at reference points between rows and columns, and small diagonal
blocks are done elementwise), ``P``, ``U``, ``W``, ``M``, ``Hc`` (:mod:`qkv.recurrent.generalized_delta.chunk_parts`).
(b) The state across chunks, ``S_in[n+1] = M_n S_in[n] + Hc_n``: N = T/C products of
``Dk×Dk`` by ``Dk×Dv``. (c) Every chunk's outputs at once from its ``S_in``. Every decay
factor is a running product of the steps' decays ``e = exp(g) <= 1`` (``exp G_t = e_1 ⋯ e_t``,
``exp(G_C - G_t) = e_{t+1} ⋯ e_C``), never ``exp(-G)`` and never a division: however strong
the decay nothing overflows, and a factor that underflows multiplies a term below the
smallest float. (One decay a head takes ``exp`` of the segment sums ``g_{s+1} + ... + g_t``,
summed in float64 from the steps, never differenced from running sums.)

**Cost.** ``O(T·C·Dk + T·Dk·(Dk + Dv) + (T/C)·Dk²·Dv)`` time, ``O(T·(C + D) + (T/C)·Dk·Dv)``
memory: no ``(T, T)`` array and no per-step state. ``chunk = 1`` is the step recurrence
itself (M = diag(e) + b aᵀ, Hc = k vᵀ). :data:`CHUNK` is the measured default.
The chunks are taken a cache-sized group at a time (:func:`qkv.recurrent.generalized_delta.chunk_parts.groups`).

**Backward**: :mod:`qkv.recurrent.generalized_delta.backward` (reverse mode through (a)-(c)).

>>> import numpy as np
>>> from qkv.recurrent.generalized_delta import chunk as dplr, naive
>>> r = np.random.default_rng(0); x = lambda *s: r.standard_normal(s)
>>> q, k, v, a, b, g = x(1, 1, 9, 4), x(1, 1, 9, 4), x(1, 1, 9, 3), x(1, 1, 9, 4), x(1, 1, 9, 4), -x(1, 1, 9, 4) ** 2
>>> o, S = dplr.forward(q, k, v, a, b, g, scale=0.5, chunk=4)
>>> o_ref, S_ref = naive.dplr_forward(q, k, v, a, b, g, scale=0.5)
>>> bool(np.allclose(o, o_ref, rtol=0, atol=1e-12) and np.allclose(S, S_ref, rtol=0, atol=1e-12))
True
"""
from __future__ import annotations

import numpy as np

from . import backward as dplr_backward
from .chunk_parts import from_chunks, groups, prepare, states

CHUNK = 32          # steps a chunk by default: measured at B=2, H=8, T=2048, D=64 float32 on one thread,
                    # 16 and 32 alike with a decay a channel (64: 1.2-1.4x slower), 32 best with one
                    # a head (1.3x over 16 and 64); float32 errors alike at 16-64 (see the tests)


def chunk_size(chunk, T: int) -> int:
    """The chunk used: ``chunk`` (default :data:`CHUNK`), at most T (a longer chunk is only padding)."""
    return max(1, min(CHUNK if chunk is None else int(chunk), T))


def outputs(ch, S_in, scale) -> np.ndarray:
    """``o (…, C, Dv) = scale · (A_qk v + A_qb U + (qt + A_qb W) S_in)`` for every chunk."""
    A_qk, A_qb = ch.A[..., 0, 0, :, :], ch.A[..., 0, 1, :, :]
    o = A_qk @ ch.v + A_qb @ ch.U                                   # (…,C,C) @ (…,C,Dv) -> (…,C,Dv)
    o += (ch.qt + A_qb @ ch.W) @ S_in                              # (…,C,Dk) @ (…,Dk,Dv) -> (…,C,Dv)
    o *= scale
    return o


def forward(q, k, v, a, b, g, *, scale, initial_state=None, chunk=None):
    """``(o (B, H, T, Dv), S_T (B, H, Dk, Dv))`` in q's dtype (float32 or float64 throughout).

    The chunks are taken a group at a time (:func:`qkv.recurrent.generalized_delta.chunk_parts.groups`), the
    state handed from group to group: passes (a)-(c) on each group in turn.
    """
    B, H, T, Dk = q.shape
    dtype = q.dtype
    S = np.zeros((B, H, Dk, v.shape[-1]), dtype) if initial_state is None else initial_state.astype(dtype)
    o = np.empty(v.shape, dtype)
    C = chunk_size(chunk, T)
    for part in groups(T, C, B * H, Dk):
        ch = prepare(*(x[:, :, part] for x in (q, k, v, a, b, g)), C)
        S_in, S = states(ch, S)
        o[:, :, part] = from_chunks(outputs(ch, S_in, scale), part.stop - part.start)
    return o, S.astype(dtype, copy=False)


def backward(dout, dstate, q, k, v, a, b, g, *, scale, initial_state=None, chunk=None):
    """``(dq, dk, dv, da, db, dg, dinitial_state)`` in q's dtype (dinitial_state None when
    initial_state is); see :mod:`qkv.recurrent.generalized_delta.backward`."""
    return dplr_backward.backward(dout, dstate, q, k, v, a, b, g, scale=scale, initial_state=initial_state,
                                  chunk=chunk_size(chunk, q.shape[2]))
