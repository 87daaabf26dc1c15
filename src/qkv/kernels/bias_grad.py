"""The gradient of a learned bias (T5's relative positions), beside any kernel.

The bias is added to the scaled and soft-capped scores, ``S = softcap(scale·Q Kᵀ) + bias``,
so its gradient is the score gradient ``dS`` itself (the softcap's slope belongs to the
product, before the bias), summed over the axes the bias was broadcast along::

    P     = exp(S - lse)                 (Tq, Tk), recomputed from the saved lse
    dP    = Z ∘ (dO Vᵀ)                  (Z = keep / (1 - p) with dropout, else 1)
    delta = rowsum(dO ∘ O)
    dS    = P ∘ (dP - delta + dlse)
    dbias = Σ over broadcast axes of dS

``dS`` is 0 wherever ``P`` is (a key the row may not see, a row that sees nothing), and is
taken as 0 there even when ``dP`` is not finite: what a hidden key's value holds never
reaches the bias. The kernels compute ``dS`` too but never keep it; here it is made again,
one leading position (batch item and head) at a time, so the memory is the bias-shaped sum
and one ``(Tq, Tk)`` block, whatever kernel ran the forward. The arrays are those of the
kernel interface (:mod:`qkv.kernels.reference`).
"""
from __future__ import annotations

import numpy as np

from .. import score_ops
from ..masks import MaskSpec


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None) -> np.ndarray:
    """``dbias`` with the shape of ``spec.bias``, in the compute dtype (q's)."""
    bias = spec.bias
    dbias = np.zeros(bias.shape, q.dtype)
    own = bias.ndim - 2                                   # the bias's own leading axes, right-aligned
    rows_summed, cols_summed = bias.shape[-2] == 1, bias.shape[-1] == 1
    for index in np.ndindex(*spec.lead):
        ds = score_grad(dout, q, k, v, out, lse, spec, scale, group, dlse, index)  # (Tq, Tk)
        if rows_summed:
            ds = ds.sum(axis=0, keepdims=True)
        if cols_summed:
            ds = ds.sum(axis=1, keepdims=True)
        at = tuple(0 if n == 1 else i for i, n in zip(index[len(index) - own:], bias.shape[:own]))
        dbias[at] += ds
    return dbias


def score_grad(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int, dlse, index: tuple) -> np.ndarray:
    """``dS (Tq, Tk)`` of one leading position ``index`` of ``spec.lead`` (see the module's equations)."""
    kv = index if group == 1 else index[:-1] + (index[-1] // group,)   # query heads h*G.. share kv head h
    qi, ki, vi = q[index], k[kv], v[kv]                                 # (Tq, D), (Tk, D), (Tk, Dv)
    dt = qi.dtype.type
    s = (qi @ ki.T) * dt(scale)                                         # (Tq, D) @ (D, Tk) -> (Tq, Tk)
    if spec.softcap is not None:
        s = score_ops.softcap(s, spec.softcap)
    add = spec.additive(index=index, dtype=s.dtype)
    if add is not None:
        s = s + add
    ok = spec.allowed(index=index)
    if ok is not None:
        s = np.where(ok, s, -np.inf)
    row_lse = lse[index][:, None]                                      # (Tq, 1)
    p = np.exp(s - np.where(row_lse == -np.inf, 0, row_lse))            # 0 where a row or key is hidden
    total = p.sum(axis=-1, keepdims=True)
    p /= np.where(total > 0, total, 1)                                  # rows sum to 1 (as the reference's)
    seen = p > 0
    with np.errstate(invalid="ignore", over="ignore"):
        dp = dout[index] @ vi.T                                         # (Tq, Dv) @ (Dv, Tk) -> (Tq, Tk)
        if spec.dropout_p:
            dp *= score_ops.keep(spec, index=index, dtype=dp.dtype)
        delta = np.sum(dout[index] * out[index], axis=-1, keepdims=True)  # (Tq, 1)
        if dlse is not None:
            delta = delta - dlse[index][:, None]
        return np.where(seen, p * (dp - delta), 0).astype(q.dtype, copy=False)
