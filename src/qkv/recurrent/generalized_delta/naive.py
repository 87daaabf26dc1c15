"""The step-by-step oracle of :func:`qkv.recurrent.dplr` (RWKV-7), in float64::

    S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ

one step a loop iteration, the backward reverse mode through the same loop (the conventions
and the read ``o_t = scale · S_tᵀ q_t``: :mod:`qkv.recurrent.steps`). The fast path it is
tested against sits beside it: :mod:`.chunk`.
"""
from __future__ import annotations

import numpy as np

from ..steps import channels, read_grad, run_steps


def dplr_forward(q, k, v, a, b, g, *, scale, initial_state=None, keep=False, dtype=np.float64):
    """``S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``: ``(o, S_T)``."""
    k, v, a, b = (x.astype(dtype) for x in (k, v, a, b))
    e = np.exp(channels(g.astype(dtype), q.shape[-1]))

    def step(t, S):
        aS = np.einsum("bhk,bhkv->bhv", a[:, :, t], S)                     # aᵀS (B,H,Dv)
        return (e[:, :, t, :, None] * S + np.einsum("bhk,bhv->bhkv", b[:, :, t], aS)
                + np.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t]))

    o, S, before = run_steps(step, q, v, scale, initial_state, keep, dtype)
    return (o, S, before) if keep else (o, S)


def dplr_backward(do, dstate, q, k, v, a, b, g, *, scale, initial_state=None, dtype=np.float64):
    """Gradients ``(dq, dk, dv, da, db, dg, dinitial_state)`` of :func:`dplr_forward`.

    Step ``S_t = e ∘ S + b (aᵀS) + k vᵀ``::

        da = S (dS_tᵀ b)      db = dS_t (Sᵀ a)      dg[i] = e[i] Σ_j dS_t[i,j] S[i,j]
        dk = dS_t v           dv = dS_tᵀ k          dS_{t-1} = e ∘ dS_t + a (bᵀ dS_t)
    """
    q, do, k, v, a, b = (x.astype(dtype) for x in (q, do, k, v, a, b))
    e = np.exp(channels(g.astype(dtype), q.shape[-1]))
    o, S_T, before = dplr_forward(q, k, v, a, b, g, scale=scale, initial_state=initial_state, keep=True, dtype=dtype)
    dq, dk, dv, da, db, dgc = (np.zeros(x.shape, dtype) for x in (q, k, v, a, b, e))
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=dtype)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = read_grad(dS, q, do, t, scale)
        dq[:, :, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        prev = before[t]
        bdS = np.einsum("bhk,bhkv->bhv", b[:, :, t], dS)                   # bᵀ dS (B,H,Dv)
        da[:, :, t] = np.einsum("bhkv,bhv->bhk", prev, bdS)
        db[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, np.einsum("bhk,bhkv->bhv", a[:, :, t], prev))
        dgc[:, :, t] = e[:, :, t] * np.einsum("bhkv,bhkv->bhk", dS, prev)
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, :, t])
        dv[:, :, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, :, t])
        dS = e[:, :, t, :, None] * dS + np.einsum("bhk,bhv->bhkv", a[:, :, t], bdS)
        S = prev
    dg = dgc if g.ndim == 4 else dgc.sum(-1)
    return dq, dk, dv, da, db, dg, dS
