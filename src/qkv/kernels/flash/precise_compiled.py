"""The precise path's pass over a float64 score tile, compiled (numba): NumPy's arithmetic, one pass.

Load it through ``qkv.jit.load(qkv.jit.PRECISE)`` only. The precise path (float64 scores:
:mod:`.forward_kernel`'s ``_fwd_precise``, :mod:`.backward_kernel`'s precise tiles) makes each
tile of scores with a float64 product, subtracts each row's offsets and rounds the result to
the compute dtype for ``exp`` (:func:`.precise.exp_shifted`). In NumPy that was three or four
passes over a tile of 2-4 MiB, beyond a core's L2 (``x *= scale``, ``x -= m``, ``x -= log l``,
``np.copyto``), and NumPy's float32 ``exp`` after them (0.6 G entries/s a core on a Zen 3,
2.5x slower below ``-87``). :func:`shifted` is one pass: for float32 it also turns the exponent
to base 2 in float64 and rounds it once, so the tiled kernel's compiled ``2^x`` (with the row
sums in its pass) follows. The scale waits for this pass where nothing else reads the scaled
tile first (the row maximum is then taken unscaled and scaled: rounding keeps order).

Each entry gets the same IEEE operations in the same order as NumPy's (no fastmath: no product
fused into a subtraction, so a row's largest score gives exactly 0), so with ``unit = 1`` the
bits are NumPy's; a difference beyond the compute dtype's range rounds to ``-inf`` (its exp is
0) without NumPy's overflow warning. On a (1024, 512) tile (Zen 3, one thread): 0.11 ms against
NumPy's 0.34 for one offset, 0.19 against 0.51 for two. (A compiled scale-and-maximum pass was
slower than NumPy's two passes, 0.25-0.60 ms against 0.26: its column maximum did not
vectorise; not kept.)
"""
from __future__ import annotations

import numba
import numpy as np

from ... import jit_cache

jit_cache.install()  # as every compiled module: qkv's cache folder before its njit


@numba.njit(nogil=True, cache=True)
def shifted(x, f, m, n, unit, out):
    """``out[i, j] = (((x[i, j] · f) - m[j]) - n[j]) · unit``, rounded once to ``out``'s dtype
    (``n`` None: one subtraction; ``f`` or ``unit`` 1: that product exact, so left out);
    ``x (w, R)`` float64."""
    w, r = x.shape
    if n is None:                     # (numba prunes the branch that does not apply to n's type)
        for i in range(w):
            if f == 1.0 and unit == 1.0:
                for j in range(r):
                    out[i, j] = x[i, j] - m[j]
            else:
                for j in range(r):
                    out[i, j] = (x[i, j] * f - m[j]) * unit
    else:
        for i in range(w):
            if f == 1.0 and unit == 1.0:
                for j in range(r):
                    out[i, j] = (x[i, j] - m[j]) - n[j]
            else:
                for j in range(r):
                    out[i, j] = ((x[i, j] * f - m[j]) - n[j]) * unit
