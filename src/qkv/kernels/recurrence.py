"""The recurrences step by step: the float64 oracle every chunked form is tested against.

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
path (:mod:`qkv.kernels.decay`, :mod:`qkv.kernels.delta`, :mod:`qkv.kernels.dplr`).
"""
from __future__ import annotations

import numpy as np


def _channels(g: np.ndarray, dk: int) -> np.ndarray:
    """``g (B,H,T)`` or ``(B,H,T,Dk)`` -> ``(B,H,T,Dk)`` (a view)."""
    return g if g.ndim == 4 else np.broadcast_to(g[..., None], g.shape + (dk,))


def _start(q, v, initial_state):
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    if initial_state is None:
        return np.zeros((B, H, Dk, Dv))
    return np.array(initial_state, dtype=np.float64)


def _run(step, q, v, scale, initial_state, keep):
    """Loop ``S <- step(t, S)``, reading ``o_t = scale · S_tᵀ q_t``; ``keep``: return every S_{t-1}."""
    q = q.astype(np.float64)
    S = _start(q, v, initial_state)
    T = q.shape[2]
    o = np.empty(q.shape[:3] + (v.shape[-1],))
    before = []
    for t in range(T):
        if keep:
            before.append(S)
        S = step(t, S)
        o[:, :, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, :, t])     # (B,H,Dk,Dv)·(B,H,Dk) -> (B,H,Dv)
    return o, S, before


def _read_grad(dS, q, do, t, scale):
    """Add the read ``o_t = scale · S_tᵀ q_t`` to ``dS_t``: ``+ scale · q_t do_tᵀ``."""
    return dS + scale * np.einsum("bhk,bhv->bhkv", q[:, :, t], do[:, :, t])


# --- decay_attention ------------------------------------------------------------------

def decay_forward(q, k, v, g, *, scale, initial_state=None, keep=False):
    """``S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ``: returns ``(o, S_T)`` (and the S_{t-1} if keep)."""
    k, v = k.astype(np.float64), v.astype(np.float64)
    a = np.exp(_channels(g.astype(np.float64), q.shape[-1]))              # (B,H,T,Dk)

    def step(t, S):
        return a[:, :, t, :, None] * S + np.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])

    o, S, before = _run(step, q, v, scale, initial_state, keep)
    return (o, S, before) if keep else (o, S)


def decay_backward(do, dstate, q, k, v, g, *, scale, initial_state=None):
    """Gradients ``(dq, dk, dv, dg, dinitial_state)`` of :func:`decay_forward`.

    Step ``S_t = a_t ∘ S_{t-1} + k_t v_tᵀ`` (``a = exp g`` on the rows)::

        dk_t = dS_t v_t      dv_t = dS_tᵀ k_t      dg_t[i] = a_t[i] Σ_j dS_t[i,j] S_{t-1}[i,j]
        dS_{t-1} = a_t ∘ dS_t

    For a decay per head ``dg_t`` sums over ``i``.
    """
    do, k, v = (x.astype(np.float64) for x in (do, k, v))
    a = np.exp(_channels(g.astype(np.float64), q.shape[-1]))
    o, S_T, before = decay_forward(q, k, v, g, scale=scale, initial_state=initial_state, keep=True)
    dq, dk, dv, dgc = (np.zeros(x.shape) for x in (q, k, v, a))
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=np.float64)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = _read_grad(dS, q, do, t, scale)
        dq[:, :, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, :, t])
        dv[:, :, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, :, t])
        prev = before[t]
        dgc[:, :, t] = a[:, :, t] * np.einsum("bhkv,bhkv->bhk", dS, prev)
        dS = a[:, :, t, :, None] * dS
        S = prev
    dg = dgc if g.ndim == 4 else dgc.sum(-1)
    return dq, dk, dv, dg, dS


# --- delta_rule -----------------------------------------------------------------------

def delta_forward(q, k, v, beta, g=None, *, scale, initial_state=None, keep=False):
    """``S' = exp(g_t) S_{t-1}``, ``S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ``: ``(o, S_T)``."""
    k, v, beta = (x.astype(np.float64) for x in (k, v, beta))
    e = np.ones(beta.shape) if g is None else np.exp(g.astype(np.float64))     # (B,H,T)

    def step(t, S):
        Sp = e[:, :, t, None, None] * S
        u = beta[:, :, t, None] * (v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, k[:, :, t]))
        return Sp + np.einsum("bhk,bhv->bhkv", k[:, :, t], u)

    o, S, before = _run(step, q, v, scale, initial_state, keep)
    return (o, S, before) if keep else (o, S)


def delta_backward(do, dstate, q, k, v, beta, g=None, *, scale, initial_state=None):
    """Gradients ``(dq, dk, dv, dbeta, dg, dinitial_state)`` of :func:`delta_forward` (dg None without g).

    Step ``S' = e S``, ``r = v - S'ᵀk``, ``u = beta r``, ``S_t = S' + k uᵀ``::

        du = dS_tᵀ k          dk = dS_t u - beta S' du       dv = beta du
        dbeta = du·r          dS' = dS_t - beta k duᵀ        dg = Σ dS'∘S'     dS_{t-1} = e dS'
    """
    do, k, v, beta = (x.astype(np.float64) for x in (do, k, v, beta))
    e = np.ones(beta.shape) if g is None else np.exp(g.astype(np.float64))
    o, S_T, before = delta_forward(q, k, v, beta, g, scale=scale, initial_state=initial_state, keep=True)
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    dbeta, dg = np.zeros(beta.shape), np.zeros(beta.shape)
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=np.float64)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = _read_grad(dS, q, do, t, scale)
        dq[:, :, t] = scale * np.einsum("bhkv,bhv->bhk", S, do[:, :, t])
        kt, bt = k[:, :, t], beta[:, :, t, None]
        Sp = e[:, :, t, None, None] * before[t]
        r = v[:, :, t] - np.einsum("bhkv,bhk->bhv", Sp, kt)               # (B,H,Dv)
        du = np.einsum("bhkv,bhk->bhv", dS, kt)
        dk[:, :, t] = np.einsum("bhkv,bhv->bhk", dS, bt * r) - bt * np.einsum("bhkv,bhv->bhk", Sp, du)
        dv[:, :, t] = bt * du
        dbeta[:, :, t] = np.einsum("bhv,bhv->bh", du, r)
        dSp = dS - np.einsum("bhk,bhv->bhkv", bt * kt, du)
        dg[:, :, t] = np.einsum("bhkv,bhkv->bh", dSp, Sp)
        dS = e[:, :, t, None, None] * dSp
        S = before[t]
    return dq, dk, dv, dbeta, (None if g is None else dg), dS


# --- dplr -----------------------------------------------------------------------------

def dplr_forward(q, k, v, a, b, g, *, scale, initial_state=None, keep=False):
    """``S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``: ``(o, S_T)``."""
    k, v, a, b = (x.astype(np.float64) for x in (k, v, a, b))
    e = np.exp(_channels(g.astype(np.float64), q.shape[-1]))

    def step(t, S):
        aS = np.einsum("bhk,bhkv->bhv", a[:, :, t], S)                     # aᵀS (B,H,Dv)
        return (e[:, :, t, :, None] * S + np.einsum("bhk,bhv->bhkv", b[:, :, t], aS)
                + np.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t]))

    o, S, before = _run(step, q, v, scale, initial_state, keep)
    return (o, S, before) if keep else (o, S)


def dplr_backward(do, dstate, q, k, v, a, b, g, *, scale, initial_state=None):
    """Gradients ``(dq, dk, dv, da, db, dg, dinitial_state)`` of :func:`dplr_forward`.

    Step ``S_t = e ∘ S + b (aᵀS) + k vᵀ``::

        da = S (dS_tᵀ b)      db = dS_t (Sᵀ a)      dg[i] = e[i] Σ_j dS_t[i,j] S[i,j]
        dk = dS_t v           dv = dS_tᵀ k          dS_{t-1} = e ∘ dS_t + a (bᵀ dS_t)
    """
    do, k, v, a, b = (x.astype(np.float64) for x in (do, k, v, a, b))
    e = np.exp(_channels(g.astype(np.float64), q.shape[-1]))
    o, S_T, before = dplr_forward(q, k, v, a, b, g, scale=scale, initial_state=initial_state, keep=True)
    dq, dk, dv, da, db, dgc = (np.zeros(x.shape) for x in (q, k, v, a, b, e))
    dS = np.zeros_like(S_T) if dstate is None else np.array(dstate, dtype=np.float64)
    S = S_T
    for t in reversed(range(q.shape[2])):
        dS = _read_grad(dS, q, do, t, scale)
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


# --- linear_scan (RG-LRU's diagonal recurrence) ----------------------------------------

def scan_forward(x, log_a, *, initial_state=None):
    """``h_t = exp(log_a_t) ∘ h_{t-1} + x_t`` on ``(B, T, D)``: returns ``(h, h_T)``."""
    x, a = x.astype(np.float64), np.exp(log_a.astype(np.float64))
    h = np.zeros(x.shape[:1] + x.shape[2:]) if initial_state is None else np.array(initial_state, np.float64)
    out = np.empty_like(x)
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        out[:, t] = h
    return out, h


def scan_backward(dh, dstate, x, log_a, *, initial_state=None):
    """Gradients ``(dx, dlog_a, dinitial_state)`` of :func:`scan_forward`:
    ``dx_t = c_t``, ``dlog_a_t = c_t ∘ a_t ∘ h_{t-1}``, ``c_{t-1} = dh_{t-1} + a_t ∘ c_t``."""
    a = np.exp(log_a.astype(np.float64))
    h, _ = scan_forward(x, log_a, initial_state=initial_state)
    h0 = np.zeros(x.shape[:1] + x.shape[2:]) if initial_state is None else np.array(initial_state, np.float64)
    prev = np.concatenate([h0[:, None], h[:, :-1]], axis=1)
    dx, dla = np.zeros(h.shape), np.zeros(h.shape)
    c = np.zeros(h0.shape) if dstate is None else np.array(dstate, np.float64)
    for t in reversed(range(x.shape[1])):
        c = c + dh[:, t]
        dx[:, t] = c
        dla[:, t] = c * a[:, t] * prev[:, t]
        c = a[:, t] * c
    return dx, dla, c
