"""Each row's own bound: the largest norm among the keys *that row* may see.

A row's result must not depend on what it may not see, to the bit. The tiled kernel's
choices of path and offset read ``max_j ‖k_j‖``: the forward's fixed offset
``m_i = max(0, U_i - C)``, ``U_i = ‖q_i‖ · kmax_i`` (in base 2, ``q`` scaled by
``log2(e)·scale``; :mod:`.forward_kernel`), whether row i may try that path at all, and the
backward's choice of its precise rows (``scale·‖q_i‖·kmax_i > TERMS``; :mod:`.precise`).
Over a task's or a head's keys, ``kmax`` would include keys row i may not see (a causal
row's future), and a large hidden key would move ``m_i`` and so the rounding of every
``2^(s - m_i)`` of the row. So ``kmax_i = max_{j visible to i} ‖k_j‖``:

- causal, window, chunk, alignment and lengths give each row one run ``[lo_i, hi_i)`` of
  keys (:func:`row_runs`, the rules of :class:`~qkv.masks.MaskSpec` row by row), whose
  maximum is a range-maximum query: a sparse table (``T[p][j] = max ‖k‖ over j..j+2^p-1``,
  ``log2`` levels over the span) answers ``max(T[p][lo], T[p][hi - 2^p])``, ``2^p <= hi - lo``;
- a user mask or a bias: the maximum over the row's allowed keys, those with a ``-inf`` bias
  left out (one pass over its rows; a finite bias, however negative, leaves a key visible).

A maximum is exact (no rounding), so where a row sees all of a task's keys ``kmax_i`` is the
task's maximum, bit for bit. Each is a cheap second step: the callers first bound every row
by the task's (or head's) maximum, and need the rows' own only where that bound decides
something (an offset above 0, a row that may not try the fast path, a precise row); since
``kmax_i`` is at most the shared one, rows the shared bound lets pass pass with their own.
"""
from __future__ import annotations

import numpy as np

from ...masks import MaskSpec
from .tiles import LOG2E, alibi_bound, batch_of


def row_runs(spec: MaskSpec, batch: int, q0: int, q1: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``, each ``(q1 - q0,)``: the keys ``[lo_i, hi_i)`` row i of ``batch`` may see
    by band, chunk and lengths (empty where ``lo >= hi``); the user mask is not read."""
    i = np.arange(q0, q1, dtype=np.int64) + spec.shift(batch)        # aligned rows, as key positions
    left, right = spec.band
    keys = spec.keys(batch)
    lo = np.zeros_like(i) if left is None else np.maximum(i - left, 0)
    hi = np.full_like(i, keys) if right is None else np.minimum(i + right + 1, keys)
    if spec.chunk is not None:
        c, ks = spec.chunk, spec.k_start
        first = (i + ks) // c * c - ks                                 # the row's chunk, in local keys
        lo, hi = np.maximum(lo, first), np.minimum(hi, first + c)
    if q1 > spec.rows(batch):
        hi = np.where(np.arange(q0, q1) < spec.rows(batch), hi, lo)   # padding rows see nothing
    return lo, hi


def range_max(norms: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(norms[lo_i:hi_i])`` for each i (0 where the run is empty), by a sparse table
    over the keys the runs span; exact, the dtype of ``norms``."""
    some = lo < hi
    if not some.any():
        return np.zeros(lo.shape, norms.dtype)
    a, b = int(lo[some].min()), int(hi[some].max())
    levels = [norms[a:b]]                                             # T[p][j] = max norms[a+j : a+j+2^p]
    while 2 ** len(levels) <= b - a:
        prev, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
    width = np.where(some, hi - lo, 1)
    p = np.frexp(width.astype(np.float64))[1] - 1                       # 2^p <= hi - lo < 2^(p+1)
    table = np.zeros((len(levels), b - a), norms.dtype)
    for n, level in enumerate(levels):
        table[n, :level.size] = level
    start = np.where(some, lo - a, 0)
    end = np.where(some, hi - a - 2 ** p, 0)
    return np.where(some, np.maximum(table[p, start], table[p, end]), 0).astype(norms.dtype, copy=False)


def row_kmax(spec: MaskSpec, norms: np.ndarray, heads: list, q0: int, q1: int, span: tuple) -> np.ndarray:
    """``kmax_i`` of rows q0:q1 of each of ``heads`` (one batch item), stacked head after head,
    ``(G·n,)``: the largest ``norms[j]`` over the keys row i may see."""
    lo, hi = row_runs(spec, batch_of(spec, heads[0]), q0, q1)
    if spec.mask is None and spec.bias is None:
        return np.tile(range_max(norms, lo, hi), len(heads))
    a, b = span
    out = []
    with np.errstate(invalid="ignore"):
        for h in heads:                                                   # a user mask or bias: its own keys a row
            ok = spec.allowed(q0, q1, a, b, index=h)
            ok = np.ones((q1 - q0, b - a), bool) if ok is None else ok
            if spec.bias is not None:
                ok = ok & (spec.additive(q0, q1, a, b, index=h) > -np.inf)
            out.append(np.max(np.broadcast_to(norms[a:b], ok.shape), axis=1, where=ok, initial=0))
    return np.concatenate(out).astype(norms.dtype, copy=False)


# --- the forward's offsets -----------------------------------------------------------------------
def offsets(qs, call, kv, task, headroom: float, loose: float) -> tuple:
    """``(m, may)``: the fixed offsets ``m_i = max(0, U_i - C)`` (base 2, the compute dtype,
    ``(R,)``; ``U_i`` bounds every visible ``s_ij``, ALiBi's term included) and whether row i
    may try the bound path (:func:`may_try`; ``(R,)``, or None: every row may). ``kmax`` is
    the task's first, each row's own (:func:`row_kmax`) where that gives an offset above 0 or
    a row that may not try. Called where overflow and NaN are quiet."""
    qnorm = np.sqrt(np.einsum("rd,rd->r", qs, qs))                        # ‖q_i‖, (R,)
    kmax = max(float(kv.norms[a:b].max()) for a, b, _ in task.runs)
    cap2 = None if call.mods is None else call.mods.cap2
    m = _offsets(qnorm, call.dt.type(kmax), call, task, headroom, cap2)
    if not m.any() and may_try(float(qnorm.max()) * kmax, call.stop2, headroom, loose, cap2):
        return m, None                                                    # as each row's own would say
    kmax = row_kmax(call.spec, kv.norms, task.heads, task.q0, task.q1, task.span).astype(call.dt)
    m = _offsets(qnorm, kmax, call, task, headroom, cap2)
    return m, may_try(qnorm.astype(np.float64) * kmax.astype(np.float64), call.stop2, headroom, loose, cap2)


def _offsets(qnorm, kmax, call, task, headroom: float, cap2: float | None) -> np.ndarray:
    bound = (qnorm * kmax).reshape(len(task.heads), -1)                  # U_i >= every s_ij, (G, n)
    if cap2:
        bound = np.minimum(bound, call.dt.type(cap2))                    # a capped score is at most c
    bound = bound + LOG2E * alibi_bound(call.spec, task.heads, task.q0, task.q1, *task.span)[:, None]
    return np.maximum(bound.reshape(-1) - headroom, 0).astype(call.dt)


def may_try(u, stop2: float, headroom: float, loose: float, cap2: float | None):
    """False for the rows that could pass the bound path only beyond ``stop2`` (it passes when
    the largest term is at least 2^-loose of 2^(U - C)), which are redone precisely; NaN: False."""
    if cap2:
        u = np.minimum(u, cap2)                                          # capped scores are at most c
    return u - headroom - loose <= stop2
