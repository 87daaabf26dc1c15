"""numba passes of the decays inside the chunks (:mod:`qkv.recurrent.decay.intra`); load it through
``qkv.jit.load(qkv.jit.DECAY_INTRA)`` only.

:func:`chunk_cumsum`: each chunk's cumulative log decay. :func:`lower_mask`: the argument of a
steep chunk's ``(C, C)`` factor ``exp(G_i - G_s)``, written once where NumPy made a float64
difference, its mask above the diagonal, the float32 copy and its flush (four passes, two
temporaries). Plain arithmetic, no fast-math: every number rounded as NumPy's passes round it
(the same bits, tested); the exp stays NumPy's, on the array this pass fills.
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def chunk_cumsum(g, floor, G):
    """``G[h, j] = cumsum(max(g[h, j], floor))`` over each chunk's rows in float64, one pass
    where NumPy makes three (the float64 copy, the maximum, the sum), each number rounded as
    NumPy rounds it (NaN kept as ``np.maximum`` keeps it). ``g (n, Nc, C, W)``, ``G`` float64."""
    n, Nc, C, W = g.shape
    for h in range(n):
        for j in range(Nc):
            for w in range(W):
                x = np.float64(g[h, j, 0, w])
                G[h, j, 0, w] = floor if x < floor else x
            for i in range(1, C):
                for w in range(W):
                    x = np.float64(g[h, j, i, w])
                    G[h, j, i, w] = G[h, j, i - 1, w] + (floor if x < floor else x)


@numba.njit(nogil=True, cache=True)
def lower_mask(G, D, flush):
    """``D[h, j, i, s] = float32(G_i - G_s)`` for ``s <= i`` (the difference in float64, then rounded),
    ``-inf`` where that is below ``flush`` (float32, compared in float32 as NumPy compares a float32
    array with a Python float; a NaN kept) and above the diagonal. ``G (n, M, C, 1)`` float64,
    ``D (n, M, C, C)`` float32: ``exp(D)`` is the factor, 0 above the diagonal and below the flush."""
    n, M, C = D.shape[:3]
    for h in range(n):
        for j in range(M):
            for i in range(C):
                gi = G[h, j, i, 0]
                row = D[h, j, i]
                for s in range(i + 1):
                    x = np.float32(gi - G[h, j, s, 0])
                    row[s] = -np.inf if x < flush else x
                for s in range(i + 1, C):
                    row[s] = -np.inf
