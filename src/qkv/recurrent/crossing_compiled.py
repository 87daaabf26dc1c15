"""The crossing sums of :mod:`qkv.recurrent.crossing` for one chunk, as inline numba helpers of the compiled
backwards (:mod:`qkv.recurrent.delta.compiled`, :mod:`qkv.recurrent.decay.compiled`), which import it; it is
compiled inside them, never loaded on its own."""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(inline="always", fastmath={"contract", "nsz", "reassoc"})
def decay_grads(after, before, whole, M, dg):
    """``dg_j = Σ_{t >= j} after_t + Σ_{t < j} before_t + whole + Σ_{s < j <= t} M_ts``, each
    term over the steps its factor crosses (:mod:`qkv.recurrent.crossing`), in float64."""
    C = dg.shape[0]
    cross = np.zeros(C)
    for t in range(C):
        run = 0.0
        for j in range(1, t + 1):
            run += M[t, j - 1]
            cross[j] += run
    later, earlier = 0.0, 0.0
    for j in range(C - 1, -1, -1):
        later += after[j]
        cross[j] += later
    for j in range(C):
        dg[j] = cross[j] + earlier + whole
        earlier += before[j]
