"""dplr step by step in the compute dtype, a segment of steps at a time: the path of a call
whose inputs hold a NaN or an inf.

The chunked form (:mod:`.chunk`) mixes a chunk's steps in products before its masks zero
what a step may not read, and ``0 · NaN`` is NaN, even in chunks of one step (the chunk's
own transition and write meet in one product): a NaN in ``k_t`` reached ``da_t``, which
reads only the state before step t. Here each step is the loop of :mod:`.naive` itself (in
q's dtype), so a NaN reaches exactly what the recurrence carries it to. Memory stays
O(T·D + (T/SEGMENT)·Dk·Dv): the backward keeps the state entering each segment and
recomputes the segment's states from it (``naive.dplr_backward`` from that entry state,
its ``dinitial_state`` the gradient handed to the segment before).
"""
from __future__ import annotations

import numpy as np

from . import naive

SEGMENT = 64   # steps whose states one segment's backward keeps


def _cuts(T: int):
    return [slice(t0, min(t0 + SEGMENT, T)) for t0 in range(0, T, SEGMENT)]


def _start(q, v, initial_state, dtype):
    B, H, _, Dk = q.shape
    if initial_state is None:
        return np.zeros((B, H, Dk, v.shape[-1]), dtype)
    return initial_state.astype(dtype)


def forward(q, k, v, a, b, g, *, scale, initial_state=None, chunk=None):
    """``(o, S_T)`` in q's dtype (``chunk``: :mod:`.chunk`'s interface, not used)."""
    dtype = q.dtype
    S, outs = _start(q, v, initial_state, dtype), []
    for cut in _cuts(q.shape[2]):
        o, S = naive.dplr_forward(*(x[:, :, cut] for x in (q, k, v, a, b, g)), scale=scale, initial_state=S,
                                  dtype=dtype)
        outs.append(o)
    o = np.concatenate(outs, axis=2) if outs else np.zeros(v.shape, dtype)
    return o, S


def backward(dout, dstate, q, k, v, a, b, g, *, scale, initial_state=None, chunk=None):
    """``(dq, dk, dv, da, db, dg, dinitial_state)`` in q's dtype (``chunk`` not used)."""
    dtype = q.dtype
    inputs = (q, k, v, a, b, g)
    S, entries = _start(q, v, initial_state, dtype), []
    for cut in _cuts(q.shape[2]):
        entries.append(S)
        _, S = naive.dplr_forward(*(x[:, :, cut] for x in inputs), scale=scale, initial_state=S, dtype=dtype)
    grads = [np.empty(x.shape, dtype) for x in inputs]
    dS = np.zeros_like(S) if dstate is None else dstate.astype(dtype)
    for cut, S_in in zip(reversed(_cuts(q.shape[2])), reversed(entries)):
        *seg, dS = naive.dplr_backward(dout[:, :, cut], dS, *(x[:, :, cut] for x in inputs), scale=scale,
                                       initial_state=S_in, dtype=dtype)
        for out, x in zip(grads, seg):
            out[:, :, cut] = x
    return (*grads, dS)
