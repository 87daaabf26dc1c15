"""Dense, exact attention forward and backward: the oracle every other path is tested against.

Forward, for one (batch, head) and scores in the compute dtype::

    X   = scale * Q Kᵀ                             (Tq, Tk)
    S   = X + bias, or c·tanh(X / c) + bias with softcap c
    S   = -inf where the query may not attend
    lse = log Σ_j exp(S_ij)                        (Tq,)   (-inf for a row that sees nothing)
    P   = exp(S - lse)                             (Tq, Tk), rows sum to 1 (or are all 0)
    O   = (P ∘ Z) V                                (Tq, Dv), Z = keep / (1 - p) with dropout, else 1

Backward, from dO = ∂L/∂O (the softmax Jacobian applied row by row), with P recomputed as
``exp(S - lse)`` and divided by its row sums: they are 1 up to the rounding of the saved
lse, which is all that is left when a score is ``finfo.min`` (a Hugging Face mask) and
``log Σ`` vanishes beside it (lse = max score, and P would sum to the number of keys); a
row whose sum leaves ``[2^-60, 2^60]`` (an lse an ulp off scores of 1e9 and more) takes
its own max instead (:func:`lse_off`)::

    dV    = (P ∘ Z)ᵀ dO
    dP    = Z ∘ (dO Vᵀ)
    delta = rowsum(dO ∘ O)  ( = rowsum(P ∘ dP) )
    dS    = P ∘ (dP - delta + dlse)       (dlse = ∂L/∂lse, where the loss uses lse; else 0)
    dX    = dS ∘ (1 - tanh²(X / c))       (with softcap; else dX = dS)
    dQ    = scale · dX K,   dK = scale · dXᵀ Q

Kernel interface (shared with :mod:`qkv.kernels.flash`): arrays arrive checked and in the compute
dtype as ``q (*L, Tq, D)``, ``k (*Lk, Tk, D)``, ``v (*Lk, Tk, Dv)``, where ``L = (..., Hq)``
is the output's leading shape and ``Lk`` is ``L`` with its last axis divided by ``group``
(query heads ``h*group .. h*group+group-1`` share kv head ``h``). They may be broadcast
views. ``spec`` is the :class:`~qkv.masks.MaskSpec` for ``L``.
"""
from __future__ import annotations

import numpy as np

from .. import score_ops
from ..masks import MaskSpec


def _expand_groups(x: np.ndarray, group: int) -> np.ndarray:
    """(..., Hkv, T, D) -> (..., Hkv*group, T, D): kv head h serves query heads h*G..h*G+G-1."""
    return x if group == 1 else np.repeat(x, group, axis=-3)


def _hide_padding(x: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Zero rows at positions >= lengths[b] (padding keys/values, or padding query rows),
    so whatever they hold (NaN too) is never read."""
    if lengths is None:
        return x
    pos = np.arange(x.shape[-2])[:, None]  # (T, 1)
    if x.ndim == 2:
        keep = pos < lengths[0]
    else:  # (B,) -> (B, 1, ..., 1) against (B, ..., T, 1)
        keep = pos < lengths.reshape((-1,) + (1,) * (x.ndim - 1))
    return np.where(keep, x, 0).astype(x.dtype, copy=False)


def _scores(q, k, spec: MaskSpec, scale: float, slope: bool = False):
    """Masked, biased, scaled scores S, -inf where attention is not allowed; with ``slope``
    also ``(S, ds/dx)``, the softcap's derivative ``1 - tanh²(x/c)`` (None without softcap)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(scale)  # (*L,Tq,D) @ (*L,D,Tk) -> (*L,Tq,Tk)
    grad = None
    if spec.softcap is not None:  # s = c·tanh(x / c), before bias and masks
        c = s.dtype.type(spec.softcap)
        t = np.tanh(s / c)
        s = c * t
        grad = 1 - t * t if slope else None
    add = spec.additive(dtype=s.dtype)
    if add is not None:
        with np.errstate(invalid="ignore"):   # inf + -inf at a hidden key: made -inf below
            s = s + add
        np.copyto(s, -np.inf, where=add == -np.inf)  # hidden even where the score is +inf (inf - inf: NaN)
    ok = spec.allowed()
    if ok is not None:
        s = np.where(ok, s, -np.inf)
    return (s, grad) if slope else s


TINY, HUGE = 2.0 ** -60, 2.0 ** 60


def lse_off(total: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """The rows (True) whose ``total = Σ_j exp(S_ij - lse_i)`` leaves ``[2^-60, 2^60]``: an
    lse an ulp or more off these scores, at magnitudes where an ulp is large (256 at 4e9: the
    forward ran another kernel, or its products rounded otherwise), made ``exp(S - lse)``
    overflow (NaN) or vanish (gradient 0). A row that sees nothing (lse ``-inf``) is not off."""
    return ~((total >= TINY) & (total <= HUGE)) & (lse != -np.inf)


def own_max(s: np.ndarray) -> tuple:
    """``(exp(S - m), Σ_j exp(S_ij - m_i))`` with each row's own max ``m`` (0 for a row that
    sees nothing): the forward's softmax, for the rows :func:`lse_off` finds."""
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(m == -np.inf, 0, m))
    return e, e.sum(axis=-1, keepdims=True)


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False):
    """Exact attention. Returns ``(out (*L,Tq,Dv), lse (*L,Tq), weights (*L,Tq,Tk) or None)``."""
    k = _hide_padding(_expand_groups(k, group), spec.kv_lengths)
    v = _hide_padding(_expand_groups(v, group), spec.kv_lengths)
    q = _hide_padding(q, spec.q_lengths)
    s = _scores(q, k, spec, scale)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)  # a row that sees nothing: keep exp(-inf - 0) = 0
    e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]  # log 0 = -inf for rows that see nothing
    p = e / np.where(total == 0, 1, total)
    if spec.dropout_p:  # P ∘ Z, Z = keep / (1 - p); lse stays the undropped one
        p = p * score_ops.keep(spec, dtype=p.dtype)
    out = np.matmul(p, v)  # (*L,Tq,Tk) @ (*L,Tk,Dv) -> (*L,Tq,Dv)
    return out, lse, (p if return_weights else None)


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None):
    """Gradients ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))`` from the saved out and lse;
    ``dlse (*L,Tq)``, the gradient of lse, adds ``P ∘ dlse`` to dS."""
    kx = _hide_padding(_expand_groups(k, group), spec.kv_lengths)
    vx = _hide_padding(_expand_groups(v, group), spec.kv_lengths)
    q = _hide_padding(q, spec.q_lengths)
    dout = _hide_padding(dout, spec.q_lengths)
    out = _hide_padding(out, spec.q_lengths)
    s, slope = _scores(q, kx, spec, scale, slope=True)
    lse_safe = np.where(lse == -np.inf, 0, lse)[..., None]
    with np.errstate(over="ignore"):  # a row past 2^60 is done again below
        p = np.exp(s - lse_safe)  # P = exp(S - lse); rows that see nothing are exp(-inf) = 0
    total = p.sum(axis=-1, keepdims=True)
    redo = lse_off(total, lse[..., None])
    if redo.any():
        e, t = own_max(s)
        p, total = np.where(redo, e, p), np.where(redo, t, total)
    p /= np.where(total > 0, total, 1)  # rows sum to 1 even where lse could not hold log Σ (see above)
    z = score_ops.keep(spec, dtype=p.dtype) if spec.dropout_p else None
    pz = p if z is None else p * z  # the dropped weights the output was made of
    dv = np.matmul(np.swapaxes(pz, -1, -2), dout)  # (*L,Tk,Tq) @ (*L,Tq,Dv) -> (*L,Tk,Dv)
    dp = np.matmul(dout, np.swapaxes(vx, -1, -2))  # (*L,Tq,Dv) @ (*L,Dv,Tk) -> (*L,Tq,Tk)
    if z is not None:
        dp *= z  # ∂L/∂P = Z ∘ (dO Vᵀ)
    delta = np.sum(dout * out, axis=-1, keepdims=True)  # (*L,Tq,1) = rowsum(P ∘ dP), dropout or not
    if dlse is not None:  # ∂lse_i/∂s_ij = P_ij
        delta = delta - _hide_padding(dlse[..., None], spec.q_lengths)
    ds = p * (dp - delta)
    if slope is not None:
        ds *= slope  # through the softcap: ∂s/∂x = 1 - tanh²(x / c)
    sc = q.dtype.type(scale)
    dq = np.matmul(ds, kx) * sc  # (*L,Tq,Tk) @ (*L,Tk,D) -> (*L,Tq,D)
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * sc  # (*L,Tk,Tq) @ (*L,Tq,D) -> (*L,Tk,D)
    if group > 1:  # sum the G query heads that shared each kv head
        hkv = dk.shape[-3] // group  # spelled out: a -1 cannot be inferred when B = 0
        dk = dk.reshape(dk.shape[:-3] + (hkv, group) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(dv.shape[:-3] + (hkv, group) + dv.shape[-2:]).sum(axis=-3)
    return dq, dk, dv
