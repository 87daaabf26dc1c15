"""The precise path's passes over a float64 score tile, compiled (numba): NumPy's bits, fewer passes.

Load it through ``qkv.jit.load(qkv.jit.PRECISE)`` only. The precise path (float64 scores:
:mod:`.forward_kernel`'s ``_fwd_precise``, :mod:`.backward_kernel`'s precise tiles) makes each
tile of scores with a float64 product, subtracts each row's offsets from it and rounds the
result to the compute dtype before ``exp``: in NumPy two or three passes over a tile of 2-4
MiB, beyond a core's L2 (``x *= scale``, ``x -= m``, ``x -= log l``, ``np.copyto``).
:func:`shifted` is one; the scale can wait for it where nothing else reads the scaled tile
first (the row maximum is then taken unscaled and scaled: rounding keeps order).

Each entry gets the same IEEE operations in the same order as NumPy's (no fastmath: no
contraction into FMAs, no reordering), so the bits are NumPy's; a difference beyond the
compute dtype's range rounds to ``-inf`` (its ``exp`` is 0) without NumPy's overflow warning.
On a (1024, 512) tile (Zen 3, one thread): 0.11 ms against NumPy's 0.34 for one offset, 0.19
against 0.51 for two. (A compiled scale-and-maximum pass was slower than NumPy's two passes,
0.25-0.60 ms against 0.26: numba's maximum over a column did not vectorise; not kept.)
"""
from __future__ import annotations

import numba
import numpy as np

from ... import jit_cache

jit_cache.install()  # as every compiled module: qkv's cache folder before its njit


@numba.njit(nogil=True, cache=True)
def shifted(x, f, m, n, out):
    """``out[i, j] = ((x[i, j] · f) - m[j]) - n[j]``, rounded to ``out``'s dtype (``f`` 1: no
    product; ``n`` None: one subtraction); ``x (w, R)`` float64."""
    w, r = x.shape
    if n is None:                     # (numba prunes the branch that does not apply to n's type)
        for i in range(w):
            if f == 1.0:
                for j in range(r):
                    out[i, j] = x[i, j] - m[j]
            else:
                for j in range(r):
                    out[i, j] = x[i, j] * f - m[j]
    else:
        for i in range(w):
            if f == 1.0:
                for j in range(r):
                    out[i, j] = (x[i, j] - m[j]) - n[j]
            else:
                for j in range(r):
                    out[i, j] = (x[i, j] * f - m[j]) - n[j]
