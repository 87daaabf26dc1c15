"""The step-by-step oracle of :func:`qkv.recurrent.delta_rule` (Gated DeltaNet, Kimi's KDA), in float64::

    S' = diag(exp g_t) S_{t-1},  S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ

with ``g`` of shape ``(B, H, T)`` (one decay a head: Gated DeltaNet) or ``(B, H, T, Dk)`` (a
decay a key channel: Kimi Delta Attention), or None (DeltaNet).

one step a loop iteration, the backward reverse mode through the same loop (the conventions
and the read ``o_t = scale · S_tᵀ q_t``: :mod:`qkv.recurrent.steps`). The fast path it is
tested against sits beside it: :mod:`.chunk`.
"""
from __future__ import annotations

import numpy as np

from ..steps import channels, read_grad, run_steps


def _decays(g, k, dtype):
    """``exp(g)`` as ``(B, H, T, Dk)`` (a head's decay repeated over its key channels)."""
    if g is None:
        return np.ones(k.shape, dtype)
    return np.exp(channels(g.astype(dtype), k.shape[-1]))


def delta_forward(q, k, v, beta, g=None, *, scale, initial_state=None, keep=False, dtype=np.float64):
    """``S' = diag(exp g_t) S_{t-1}``, ``S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ``: ``(o, S_T)``."""
    k, v, beta = (x.astype(dtype) for x in (k, v, beta))
    e = _decays(g, k, dtype)                                                    # (B,H,T,Dk)

    def step(t, S):
        Sp = e[:, :, t, :, None] * S
        u = beta[:, :, t, None] * (v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, k[:, :, t]))
        return Sp + np.einsum("bhk,bhv->bhkv", k[:, :, t], u)

    o, S, before = run_steps(step, q, v, scale, initial_state, keep, dtype)
    return (o, S, before) if keep else (o, S)


def delta_backward(do, dstate, q, k, v, beta, g=None, *, scale, initial_state=None, dtype=np.float64):
    """Gradients ``(dq, dk, dv, dbeta, dg, dinitial_state)`` of :func:`delta_forward` (dg None without
    g, else of g's shape).

    Step ``S' = diag(e) S``, ``r = v - S'ᵀk``, ``u = beta r``, ``S_t = S' + k uᵀ``::

        du = dS_tᵀ k          dk = dS_t u - beta S' du       dv = beta du
        dbeta = du·r          dS' = dS_t - beta k duᵀ        dS_{t-1} = diag(e) dS'
        dg_d = Σ_v dS'_dv S'_dv   (a key channel's row; a head's decay: summed over d too)
    """
    q, do, k, v, beta = (x.astype(dtype) for x in (q, do, k, v, beta))
    e = _decays(g, k, dtype)
    o, S_T, before = delta_forward(q, k, v, beta, g, scale=scale, initial_state=initial_state, keep=True,
                                   dtype=dtype)
    dq, dk, dv = (np.zeros(x.shape, dtype) for x in (q, k, v))
    dbeta, dg = np.zeros(beta.shape, dtype), np.zeros(k.shape, dtype)
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=dtype)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = read_grad(dS, q, do, t, scale)
        dq[:, :, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        kt, bt = k[:, :, t], beta[:, :, t, None]
        Sp = e[:, :, t, :, None] * before[t]
        r = v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, kt)               # (B,H,Dv)
        du = np.einsum("bhkv,bhk->bhv", dS, kt)
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, bt * r) - bt * np.einsum("bhkv,bhv->bhk", Sp, du)
        dv[:, :, t] = bt * du
        dbeta[:, :, t] = np.einsum("bhv,bhv->bh", du, r)
        dSp = dS - np.einsum("bhk,bhv->bhkv", bt * kt, du)
        dg[:, :, t] = np.einsum("bhkv,bhkv->bhk", dSp, Sp)
        dS = e[:, :, t, :, None] * dSp
        S = before[t]
    if g is not None and g.ndim == 3:
        dg = dg.sum(-1)
    return dq, dk, dv, dbeta, (None if g is None else dg), dS
