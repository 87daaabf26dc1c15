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
import numpy as np


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


@numba.njit(nogil=True, cache=True)
def selective_step(state, x, delta, decay, B, C, D, z, out):
    """One decoding step of a selective state (mamba_ssm's ``selective_state_update``), in one pass
    over ``state (Bsz, H, P, N)``, in place::

        state = state · decay + (Δ x) B,    out = Σ_n state C + D x,    · silu(z)

    ``x (Bsz, H, P)``; ``delta (Bsz, H, P | 1)`` (Δ, after its bias and softplus); ``decay
    (Bsz, H, P | 1, N | 1)`` (``exp(Δ A)``, made by the caller); ``B, C (Bsz, G, N)`` (head h
    reads group ``h // (H / G)``); ``D (H, P | 1)`` or ``(0, 0)``; ``z (Bsz, H, P)`` or ``(0, 0, 0)``;
    ``out (Bsz, H, P)``. The state's update rounds as ``state * decay + (Δ x) B`` does (the
    products, then the sum; no contraction); the read ``Σ_n`` sums in float64 (:func:`_dot64`),
    rounded once."""
    Bsz, H, P, N = state.shape
    per_p, per_n = decay.shape[2] > 1, decay.shape[3] > 1
    dp, G = delta.shape[2] > 1, B.shape[1]
    has_D, has_z, Dp = D.shape[0] > 0, z.shape[0] > 0, D.shape[1] > 1
    one = state.dtype.type(1.0)
    for b in range(Bsz):
        for h in range(H):
            g = h // (H // G)
            Bg, Cg = B[b, g], C[b, g]
            for p in range(P):
                dx = delta[b, h, p if dp else 0] * x[b, h, p]
                e, s = decay[b, h, p if per_p else 0], state[b, h, p]
                if per_n:
                    for n in range(N):
                        s[n] = s[n] * e[n] + dx * Bg[n]
                else:
                    f = e[0]
                    for n in range(N):
                        s[n] = s[n] * f + dx * Bg[n]
                y = state.dtype.type(_dot64(s, Cg))
                if has_D:
                    y = y + x[b, h, p] * D[h, p if Dp else 0]
                if has_z:
                    zz = z[b, h, p]
                    y = y * (zz / (one + np.exp(-zz)))
                out[b, h, p] = y


@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _dot64(s, c):
    """``Σ_n s_n c_n`` of two float32 (or float64) rows in float64, its partial sums in the vector
    lanes (the order of this CPU's vector width: the same bits on it every call; rounded to
    float32 after, the order shows in about no output). In one chain of additions it took 60 µs
    at 16 heads of (64, 64), latency-bound; 9 µs so."""
    acc = 0.0
    for n in range(s.shape[0]):
        acc += np.float64(s[n]) * np.float64(c[n])
    return acc
