"""A decoding step of the delta rule: fla's ``fused_recurrent_*`` at ``T = 1`` without autograd,
what transformers calls once a layer a generated token (:mod:`qkv.torch.hf_kernels.fla`).

A step is a few products of a ``(K, V)`` state a head, so what costs is the number of passes
over the states and of calls: :func:`step` runs the compiled step of
:func:`qkv.recurrent.delta.compiled.decode_step` (the l2norm, the grouped heads and the gates
inside, the state read once and written once), and where the compiled passes are off
(``QKV_JIT=0``, no numba) the same equation in a few torch products (:func:`torch_step`).
Both compute in float32 (float64 for float64 q) and return ``(o (B, 1, HV, V), S (B, HV, K, V))``.
"""
from __future__ import annotations

import numpy as np
import torch

from ... import jit
from ...recurrent.checked import check_gate
from .fla_args import L2NORM_EPS, l2norm as _l2norm


def _array(x: torch.Tensor, dt) -> np.ndarray:
    """``x`` as a C-ordered array of ``dt``: a view where it is one already (each torch call
    skipped here is 1-2 µs of a step that takes ~100)."""
    x = x.detach() if x.requires_grad else x
    x = x if x.dtype == dt else x.to(dt)
    return x.contiguous().numpy()


def _check_gate(name: str, x: torch.Tensor) -> None:
    """:func:`qkv.recurrent.checked.check_gate` on ``x``: its test on a view of x where NumPy has x's
    dtype (the same answer), and on its float64 copy, which names the value, where that fails."""
    x = x.detach()
    if x.dtype in (torch.float32, torch.float64):
        a = x.numpy()
        if np.isfinite(a).all() and (name != "log_decay" or (a <= 0).all()):
            return
    check_gate(name, x.double().numpy())


def step(q, k, v, beta, g, scale: float, S0, l2norm: bool):
    """One step on fla's layout: ``q, k (B, 1, H, K)``, ``v (B, 1, HV, V)``, ``beta (B, 1, HV)``,
    ``g`` None, ``(B, 1, HV)`` or ``(B, 1, HV, K)``, ``S0`` None or ``(B, HV, K, V)``. The gates
    are checked as the chunked path checks them (:func:`qkv.recurrent.checked.check_gate`)."""
    _check_gate("beta", beta)
    if g is not None:
        _check_gate("log_decay", g)
    compiled = jit.load(jit.DELTA)
    if compiled is None:
        return torch_step(q, k, v, beta, g, scale, S0, l2norm)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = torch.zeros(B, HV, 1, dtype=dt) if g is None else (g[:, 0, :, None] if g.dim() == 3 else g[:, 0])
    state = np.empty((1, 1, 1, 1), np.float64 if dt == torch.float64 else np.float32) if S0 is None else _array(S0, dt)
    o = np.empty((B, HV, V), state.dtype)
    S = np.empty((B, HV, K, V), state.dtype)
    compiled.decode_step(_array(q[:, 0], dt), _array(k[:, 0], dt), _array(v[:, 0], dt), _array(beta[:, 0], dt),
                         _array(gate, dt), state, S0 is not None, bool(l2norm), L2NORM_EPS, float(scale), o, S)
    return torch.from_numpy(o)[:, None], torch.from_numpy(S)


def torch_step(q, k, v, beta, g, scale: float, S0, l2norm: bool):
    """:func:`step` in torch products (the compiled passes off)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q1, k1 = q[:, 0].to(dt), k[:, 0].to(dt)                              # (B, H, K)
    if l2norm:
        q1, k1 = _l2norm(q1), _l2norm(k1)
    if HV != H:
        q1, k1 = q1.repeat_interleave(HV // H, dim=1), k1.repeat_interleave(HV // H, dim=1)
    v1, b1 = v[:, 0].to(dt), beta[:, 0].to(dt)
    S = torch.zeros(B, HV, K, V, dtype=dt) if S0 is None else S0.to(dt)
    if g is not None:                                                    # S' = diag(e^g) S
        e = torch.exp(g[:, 0].to(dt))
        S = S * (e[..., None, None] if e.dim() == 2 else e[..., None])
    u = b1[..., None] * (v1 - torch.matmul(k1[:, :, None], S)[:, :, 0])  # beta (v - S'ᵀk)
    S = S + k1[..., None] * u[:, :, None]                                # + k uᵀ
    o = scale * torch.matmul(q1[:, :, None], S)                          # scale · Sᵀq: (B, HV, 1, V)
    return o.transpose(1, 2), S
