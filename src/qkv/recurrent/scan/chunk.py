"""Griffin's diagonal linear recurrence ``h_t = a_t ∘ h_{t-1} + x_t`` (``a_t = exp(log_a_t)``)
on ``(B, T, D)``, as a blocked scan: about ``2·sqrt(T)`` vectorised steps instead of T.

**Blocks.** Cut the T steps into N blocks of C (``C ≈ sqrt(T)``). Inside block n, with
``h_in`` the state entering it and ``P_t = a_1 ∘ ... ∘ a_t`` the block's running decay::

    h_t = hloc_t + P_t ∘ h_in,       hloc_t = a_t ∘ hloc_{t-1} + x_t,  hloc_0 = 0

so (1) ``hloc`` for every block at once: C steps, each over all N blocks; (2) the states
between blocks, ``h_in[n+1] = hloc_C[n] + P_C[n] ∘ h_in[n]``: N steps; (3) ``h = hloc + P ∘ h_in``
at once. ``P`` is a running product of factors ``<= 1`` (never ``exp(-cumsum)``): it cannot
overflow, and where it underflows the term it multiplies is below the smallest float. The
work is the loop's (a few multiply-adds a step and channel); what changes is the number of
Python-level steps, ``C + N`` instead of T.

**Backward.** With ``c_t = ∂L/∂h_t`` through both its read and the next step::

    c_t = dh_t + a_{t+1} ∘ c_{t+1},   c_T = dh_T + dstate
    dx_t = c_t,   dlog_a_t = c_t ∘ a_t ∘ h_{t-1},   dh_0 = a_1 ∘ c_1

``c`` is the same recurrence run backwards in time (inputs ``dh`` reversed, decays
``a_{t+1}`` reversed and shifted, starting from ``dstate``): the blocked forward again.
float32 computes in float32 (float16 too, cast back), float64 in float64.

**When.** A step of the plain loop costs a few NumPy calls over ``B·D`` numbers: for narrow
problems the calls dominate and the blocked scan, with ``2·sqrt(T)`` of them, is 2-3x faster
(B·D = 16 to 128 at T = 2048); for wide ones each call already streams its data and the
blocked scan's extra passes (its strided block steps, the running products) cost more, so
above :data:`BLOCKED_WIDTH` the loop runs, in place.
"""
from __future__ import annotations

import math

import numpy as np

BLOCKED_WIDTH = 512     # B·D up to which the blocked scan beats the step loop (measured: 2-3x below,
                        # 1.1x slower at 1024 and 2-3x slower above: wide steps are already efficient)


def _block(T: int) -> int:
    """C ≈ sqrt(T): the two loops, C and T/C steps, are balanced."""
    return max(1, math.isqrt(max(T - 1, 0)) + 1)


def _blocks(x: np.ndarray, C: int) -> np.ndarray:
    """``(B, T, D) -> (B, N, C, D)``, zero steps appended (x = 0 adds nothing, log_a = 0 keeps h)."""
    B, T, D = x.shape
    N = -(-T // C)
    x = np.pad(x, [(0, 0), (0, N * C - T), (0, 0)]) if N * C != T else x
    return x.reshape(B, N, C, D)


def _compiled():
    """:mod:`qkv.recurrent.scan.compiled`, or None (no numba, or ``QKV_JIT=0``)."""
    from ... import jit

    return jit.load(jit.SCAN)


def _steps(x: np.ndarray, log_a: np.ndarray, h0):
    """``(h, h_T)`` step by step, in place, each step over all ``B·D`` channels (with the fast
    extra one compiled pass, the same bits)."""
    a = np.exp(log_a)
    h = np.empty_like(x)
    fast = _compiled()
    if fast is not None and x.shape[1]:
        B, _, D = x.shape
        fast.forward(np.ascontiguousarray(a), np.ascontiguousarray(x),
                     np.zeros((B, D), x.dtype) if h0 is None else np.ascontiguousarray(h0), h)
        return h, h[:, -1].copy()
    prev = np.zeros(x.shape[::2], x.dtype) if h0 is None else h0
    for t in range(x.shape[1]):
        np.multiply(a[:, t], prev, out=h[:, t])
        h[:, t] += x[:, t]
        prev = h[:, t]
    return h, prev.copy()


def _scan(x: np.ndarray, log_a: np.ndarray, h0):
    """``(h (B, T, D), h_T (B, D))`` in x's dtype: blocked when ``B·D <= BLOCKED_WIDTH``."""
    B, T, D = x.shape
    if B * D == 0:                                                  # no channel: nothing to carry
        return np.empty_like(x), np.zeros((B, D), x.dtype)
    if B * D > BLOCKED_WIDTH:
        return _steps(x, log_a, h0)
    C = _block(T)
    xb = _blocks(x, C)
    a = np.exp(_blocks(log_a, C))                                   # (B,N,C,D)
    h = np.empty_like(xb)                                           # hloc, then h
    h[:, :, 0] = xb[:, :, 0]
    for t in range(1, C):                                           # (1) inside every block at once
        np.multiply(a[:, :, t], h[:, :, t - 1], out=h[:, :, t])
        h[:, :, t] += xb[:, :, t]
    P = np.cumprod(a, axis=2, out=a)                                # the blocks' running decays
    N = xb.shape[1]
    h_in = np.empty((B, N, 1, D), x.dtype)
    s = np.zeros((B, D), x.dtype) if h0 is None else h0
    for n in range(N):                                              # (2) across blocks
        h_in[:, n, 0] = s
        s = h[:, n, -1] + P[:, n, -1] * s
    P *= h_in
    h += P                                                          # (3) every block's start
    return h.reshape(B, -1, D)[:, :T], s


def _dtype(x):
    return np.dtype(np.float64 if x.dtype == np.float64 else np.float32)


def forward(x, log_a, *, initial_state=None):
    """``(h (B, T, D), h_T (B, D))`` in x's dtype."""
    dt = _dtype(x)
    h0 = None if initial_state is None else initial_state.astype(dt)
    h, hT = _scan(x.astype(dt, copy=False), log_a.astype(dt, copy=False), h0)
    return h.astype(x.dtype, copy=False), hT.astype(x.dtype, copy=False)


def backward(dout, dstate, x, log_a, *, initial_state=None):
    """``(dx, dlog_a, dinitial_state)`` in x's dtype (the module docstring's backward)."""
    dt, out_dtype = _dtype(x), x.dtype
    x, la, dh = (z.astype(dt, copy=False) for z in (x, log_a, dout))
    B, T, D = x.shape
    h0 = np.zeros((B, D), dt) if initial_state is None else initial_state.astype(dt)
    fast = _compiled() if B * D > BLOCKED_WIDTH and T else None
    if fast is not None:                                            # the same bits in one pass
        h, _ = _scan(x, la, h0)
        a = np.exp(la)
        c, dla, dh0 = np.empty_like(x), np.empty_like(x), np.empty_like(h0)
        fast.backward(a, h, np.ascontiguousarray(h0), np.ascontiguousarray(dh),
                      np.zeros((B, D), dt) if dstate is None else np.ascontiguousarray(dstate, dtype=dt), c, dla, dh0)
        return tuple(z.astype(out_dtype, copy=False) for z in (c, dla, dh0))
    back_decay = np.zeros_like(la)                                  # a_{t+1} reversed: 1, a_T, ..., a_2
    back_decay[:, 1:] = la[:, :0:-1]
    ds = None if dstate is None else dstate.astype(dt)
    c, _ = _scan(np.ascontiguousarray(dh[:, ::-1]), back_decay, ds)
    c = c[:, ::-1].copy()                                          # (B,T,D): c_t (forward order: products of it too)
    h, _ = _scan(x, la, h0)
    prev = np.concatenate([h0[:, None], h[:, :-1]], axis=1)         # h_{t-1}
    a = np.exp(la)
    dla = c * a * prev
    dh0 = a[:, 0] * c[:, 0] if T else (np.zeros((B, D), dt) if ds is None else ds)
    out = (c, dla, dh0)
    return tuple(z.astype(out_dtype, copy=False) for z in out)
