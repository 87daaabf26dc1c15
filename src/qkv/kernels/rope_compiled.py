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
    """``x (M, T, D)`` (any strides), ``cos, sin (T, D/2)`` and ``out (M, T, D)`` of x's dtype
    (float32 or float64): row t of each ``x[m]`` rotated by the angles of row t."""
    M, T, D = x.shape
    h = D // 2
    for m in range(M):
        for t in range(T):
            c, s, xr, o = cos[t], sin[t], x[m, t], out[m, t]
            for i in range(h):
                a, b = xr[i], xr[h + i]
                o[i] = a * c[i] - b * s[i]
                o[h + i] = b * c[i] + a * s[i]
