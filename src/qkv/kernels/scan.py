"""The scan recurrence's fast path (for now: the float64 step oracle of
:mod:`qkv.kernels.recurrence`, cast back; the chunked form replaces it)."""
from __future__ import annotations

from . import recurrence


def forward(x, *args, initial_state=None, **kw):
    """``(o, final_state)`` in q's dtype."""
    o, S = recurrence.scan_forward(x, *args, initial_state=initial_state, **kw)
    return o.astype(x.dtype), S.astype(x.dtype)


def backward(dout, dstate, x, *args, initial_state=None, **kw):
    """Every input's gradient, in q's dtype (None for an input that is None)."""
    grads = recurrence.scan_backward(dout, dstate, x, *args, initial_state=initial_state, **kw)
    return tuple(None if g is None else g.astype(x.dtype) for g in grads)
