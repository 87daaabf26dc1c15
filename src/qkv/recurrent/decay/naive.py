"""The step-by-step oracle of :func:`qkv.recurrent.decay_attention` (Mamba-2's SSD, GLA), in float64::

    S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ

one step a loop iteration, the backward reverse mode through the same loop (the conventions
and the read ``o_t = scale · S_tᵀ q_t``: :mod:`qkv.recurrent.steps`). The fast path it is
tested against sits beside it: :mod:`.chunk`.
"""
from __future__ import annotations

import numpy as np

from ..steps import channels, read_grad, run_steps


def decay_forward(q, k, v, g, *, scale, initial_state=None, keep=False, dtype=np.float64):
    """``S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ``: returns ``(o, S_T)`` (and the S_{t-1} if keep)."""
    k, v = k.astype(dtype), v.astype(dtype)
    a = np.exp(channels(g.astype(dtype), q.shape[-1]))                   # (B,H,T,Dk)

    def step(t, S):
        return a[:, :, t, :, None] * S + np.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])

    o, S, before = run_steps(step, q, v, scale, initial_state, keep, dtype)
    return (o, S, before) if keep else (o, S)


def decay_backward(do, dstate, q, k, v, g, *, scale, initial_state=None, dtype=np.float64):
    """Gradients ``(dq, dk, dv, dg, dinitial_state)`` of :func:`decay_forward`.

    Step ``S_t = a_t ∘ S_{t-1} + k_t v_tᵀ`` (``a = exp g`` on the rows)::

        dk_t = dS_t v_t      dv_t = dS_tᵀ k_t      dg_t[i] = a_t[i] Σ_j dS_t[i,j] S_{t-1}[i,j]
        dS_{t-1} = a_t ∘ dS_t

    For a decay per head ``dg_t`` sums over ``i``.
    """
    q, do, k, v = (x.astype(dtype) for x in (q, do, k, v))
    a = np.exp(channels(g.astype(dtype), q.shape[-1]))
    o, S_T, before = decay_forward(q, k, v, g, scale=scale, initial_state=initial_state, keep=True, dtype=dtype)
    dq, dk, dv, dgc = (np.zeros(x.shape, dtype) for x in (q, k, v, a))
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=dtype)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = read_grad(dS, q, do, t, scale)
        dq[:, :, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, :, t])
        dv[:, :, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, :, t])
        prev = before[t]
        dgc[:, :, t] = a[:, :, t] * np.einsum("bhkv,bhkv->bhk", dS, prev)
        dS = a[:, :, t, :, None] * dS
        S = prev
    dg = dgc if g.ndim == 4 else dgc.sum(-1)
    return dq, dk, dv, dg, dS
