"""The step-by-step oracle of :func:`qkv.recurrent.linear_scan` (Griffin's RG-LRU), in float64::

    h_t = exp(log_a_t) ∘ h_{t-1} + x_t

one step a loop iteration, the backward reverse mode through the same loop (the conventions
and the read ``o_t = scale · S_tᵀ q_t``: :mod:`qkv.recurrent.steps`). The fast path it is
tested against sits beside it: :mod:`.chunk`.
"""
from __future__ import annotations

import numpy as np


def scan_forward(x, log_a, *, initial_state=None, dtype=np.float64):
    """``h_t = exp(log_a_t) ∘ h_{t-1} + x_t`` on ``(B, T, D)``: returns ``(h, h_T)``."""
    x, a = x.astype(dtype), np.exp(log_a.astype(dtype))
    h = np.zeros(x.shape[:1] + x.shape[2:], dtype) if initial_state is None else np.array(initial_state, dtype)
    out = np.empty_like(x)
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        out[:, t] = h
    return out, h


def scan_backward(dh, dstate, x, log_a, *, initial_state=None, dtype=np.float64):
    """Gradients ``(dx, dlog_a, dinitial_state)`` of :func:`scan_forward`:
    ``dx_t = c_t``, ``dlog_a_t = c_t ∘ a_t ∘ h_{t-1}``, ``c_{t-1} = dh_{t-1} + a_t ∘ c_t``."""
    a, dh = np.exp(log_a.astype(dtype)), dh.astype(dtype)
    h, _ = scan_forward(x, log_a, initial_state=initial_state, dtype=dtype)
    h0 = np.zeros(x.shape[:1] + x.shape[2:], dtype) if initial_state is None else np.array(initial_state, dtype)
    prev = np.concatenate([h0[:, None], h[:, :-1]], axis=1)
    dx, dla = np.zeros(h.shape, dtype), np.zeros(h.shape, dtype)
    c = np.zeros(h0.shape, dtype) if dstate is None else np.array(dstate, dtype)
    for t in reversed(range(x.shape[1])):
        c = c + dh[:, t]
        dx[:, t] = c
        dla[:, t] = c * a[:, t] * prev[:, t]
        c = a[:, t] * c
    return dx, dla, c
