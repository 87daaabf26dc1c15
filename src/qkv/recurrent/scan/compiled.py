"""numba passes of Griffin's diagonal recurrence (:mod:`qkv.recurrent.scan.chunk`, the step loop of wide
problems); load them through ``qkv.jit.load(qkv.jit.SCAN)`` only.

NumPy's step loop makes two ufunc calls a time step over ``B·D`` numbers and its backward runs
the scan twice more over reversed copies (the carry, then ``h`` again), with a concatenation
and three products after: at an MQAR RG-LRU layer, ``(16, 256, 128)`` float32, about 4 ms
forward and 11 ms backward. These are one pass each. The decays ``a = exp(log a)`` come in
from NumPy's ``exp`` and the arithmetic is plain (no fast-math contraction), each product and
sum rounded as the step loop rounds it, so both paths give the same bits.
"""
from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def forward(a, x, h0, h):
    """``h_t = a_t ∘ h_{t-1} + x_t`` into ``h``; ``a, x, h (B, T, D)``, ``h0 (B, D)`` (zeros for none)."""
    B, T, D = x.shape
    for b in range(B):
        prev = h0[b]
        for t in range(T):
            at, xt, ht = a[b, t], x[b, t], h[b, t]
            for d in range(D):
                ht[d] = at[d] * prev[d] + xt[d]
            prev = ht


@numba.njit(nogil=True, cache=True)
def backward(a, h, h0, dh, ds, c, dla, dh0):
    """The carry ``c_t = a_{t+1} ∘ c_{t+1} + dh_t`` (``c_T``'s ``a`` is 1, its carry ``ds``, zeros for
    none) into ``c``, ``dla_t = c_t ∘ a_t ∘ h_{t-1}`` (``h_{-1} = h0``), ``dh0 = a_0 ∘ c_0``.
    ``a, h, dh, c, dla (B, T, D)``; ``h0, ds, dh0 (B, D)``; T >= 1."""
    B, T, D = dh.shape
    one = a.dtype.type(1.0)
    for b in range(B):
        for t in range(T - 1, -1, -1):
            ct, dt = c[b, t], dh[b, t]
            if t == T - 1:
                carry = ds[b]
                for d in range(D):
                    ct[d] = one * carry[d] + dt[d]
            else:
                nxt, carry = a[b, t + 1], c[b, t + 1]
                for d in range(D):
                    ct[d] = nxt[d] * carry[d] + dt[d]
            at, g = a[b, t], dla[b, t]
            prev = h[b, t - 1] if t else h0[b]
            for d in range(D):
                g[d] = ct[d] * at[d] * prev[d]
        a0, c0, out = a[b, 0], c[b, 0], dh0[b]
        for d in range(D):
            out[d] = a0[d] * c0[d]
