"""numba pass of rotary position embedding (:func:`qkv.positional.rope`); load it through
``qkv.jit.load(qkv.jit.ROPE)`` only.

:func:`rotate`: ``out = (x1 cos - x2 sin, x2 cos + x1 sin)`` with ``x1, x2`` the two halves of
each row, in one pass over ``x`` where NumPy takes six ufunc calls, four temporaries and a
concatenation (at an MQAR attention step, ``(64, 1, 256, 64)`` float32, about 2 ms a call,
eight calls a training step). Plain arithmetic, no fast-math contraction: each number is
rounded as NumPy's path rounds it (two products, then the difference), so the two paths give
the same bits.
"""
from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def rotate(x, cos, sin, out):
    """``x (B, H, T, D)`` (any strides: the heads of a ``(B, T, H, D)`` projection are read where
    they lie), ``cos, sin (T, D/2)`` and ``out (B, H, T, D)`` of x's dtype (float32 or float64):
    row t of each ``x[b, h]`` rotated by the angles of row t."""
    B, H, T, D = x.shape
    h2 = D // 2
    for b in range(B):
        for hh in range(H):
            for t in range(T):
                c, s, xr, o = cos[t], sin[t], x[b, hh, t], out[b, hh, t]
                for i in range(h2):
                    u, w = xr[i], xr[h2 + i]
                    o[i] = u * c[i] - w * s[i]
                    o[h2 + i] = w * c[i] + u * s[i]
