"""The recurrences step by step: the float64 oracle every chunked form is tested against (and,
with ``dtype=np.float32``, the plain float32 step loop whose error is the float32 yardstick).

Each (batch, head) keeps a state ``S`` of shape ``(Dk, Dv)`` and reads it with the query::

    decay_attention  S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ                     (Mamba-2's SSD, GLA)
    delta_rule       S'  = exp(g_t) S_{t-1}
                     S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ                   (Gated DeltaNet)
    dplr             S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ        (RWKV-7)
    every one        o_t = scale · S_tᵀ q_t

with ``g`` of shape ``(B, H, T)`` (one decay a head, broadcast over the key channels) or
``(B, H, T, Dk)`` (a decay a key channel), as flash-linear-attention's ``naive`` functions
write them. ``linear_scan`` is the diagonal recurrence of Griffin's RG-LRU,
``h_t = exp(log_a_t) ∘ h_{t-1} + x_t`` on ``(B, T, D)``.

**Backward** (reverse-mode through the same loop). With ``dS_t`` the gradient reaching
``S_t`` (from its read ``o_t`` and from ``S_{t+1}``)::

    dS_t     = scale · q_t do_tᵀ + (gradient through step t+1)       dS_T starts from dstate
    dq_t     = scale · S_t do_t

and each step's own rule, written beside its forward step below. The states are kept
(``T·Dk·Dv`` numbers a head): this is the oracle, for tests at small sizes, not the fast
path (:mod:`qkv.recurrent.decay.chunk`, :mod:`qkv.recurrent.delta.chunk`, :mod:`qkv.recurrent.generalized_delta.chunk`).
"""
from __future__ import annotations

import numpy as np


def channels(g: np.ndarray, dk: int) -> np.ndarray:
    """``g (B,H,T)`` or ``(B,H,T,Dk)`` -> ``(B,H,T,Dk)`` (a view)."""
    return g if g.ndim == 4 else np.broadcast_to(g[..., None], g.shape + (dk,))


def start_state(q, v, initial_state, dtype=np.float64):
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    if initial_state is None:
        return np.zeros((B, H, Dk, Dv), dtype)
    return np.array(initial_state, dtype=dtype)


def run_steps(step, q, v, scale, initial_state, keep, dtype=np.float64):
    """Loop ``S <- step(t, S)``, reading ``o_t = scale · S_tᵀ q_t``; ``keep``: return every S_{t-1}."""
    q = q.astype(dtype)
    S = start_state(q, v, initial_state, dtype)
    T = q.shape[2]
    o = np.empty(q.shape[:3] + (v.shape[-1],), dtype)
    before = []
    for t in range(T):
        if keep:
            before.append(S)
        S = step(t, S)
        o[:, :, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, :, t])     # (B,H,Dk,Dv)·(B,H,Dk) -> (B,H,Dv)
    return o, S, before


def read_grad(dS, q, do, t, scale):
    """Add the read ``o_t = scale · S_tᵀ q_t`` to ``dS_t``: ``+ scale · q_t do_tᵀ``."""
    return dS + scale * np.einsum("bhk,bhv->bhkv", q[:, :, t], do[:, :, t])

