"""The dplr recurrence's fast path (for now: the float64 step oracle of
:mod:`qkv.kernels.recurrence`, cast back; the chunked form replaces it)."""
from __future__ import annotations

from . import recurrence


def forward(q, *args, initial_state=None, chunk=None, **kw):
    """``(o, final_state)`` in q's dtype."""
    o, S = recurrence.dplr_forward(q, *args, initial_state=initial_state, **kw)
    return o.astype(q.dtype), S.astype(q.dtype)


def backward(dout, dstate, q, *args, initial_state=None, chunk=None, **kw):
    """Every input's gradient, in q's dtype (None for an input that is None)."""
    grads = recurrence.dplr_backward(dout, dstate, q, *args, initial_state=initial_state, **kw)
    return tuple(None if g is None else g.astype(q.dtype) for g in grads)
