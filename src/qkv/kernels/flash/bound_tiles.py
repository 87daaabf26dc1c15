"""The bound path's tiles (:mod:`.forward_kernel`): ``2^(S - m)`` at fixed offsets, its sums and ``P V``.

:func:`run` takes a task's tiles, in order, in one compiled call (:mod:`.task_compiled`) where
that call computes exactly what :func:`tile` does: float32, the ``fast`` extra loaded, no softcap,
dropout or ALiBi, each masked tile a causal or window diagonal of one head, and every product a
matrix product as NumPy's ``matmul`` makes it (no dimension of 1, where NumPy takes a
matrix-vector product). Else it calls :func:`tile` for each. The compiled call holds no GIL;
:func:`tile`'s Python holds it between the products, and a second thread's tiles wait on it.
"""
from __future__ import annotations

import numpy as np

from ... import jit
from . import exp2 as pow2
from . import modifiers
from .exp2 import _FAR
from .tiles import batch_of, mask_and_bias, scratch, structural


def tile(qs, kk, vv, m, acc, l, spec, heads, q0, q1, a, b, rows, dt, tiles, mods=None, keys=None) -> None:
    """One tile of the bound path: keys a:b against rows ``r0:r1`` (of the task's q0:q1),
    ``rows = (r0, r1, partial)``, offsets ``m`` (None: 0); adds ``Σ p v`` into ``acc`` and
    ``Σ p`` into ``l`` (in the exponential's pass: a column of ones beside V, which was how
    the sums came before, slows OpenBLAS's product by 10 % at Dv = 64)."""
    r0, r1, partial_ = rows
    i0, i1 = _stacked_rows(qs, rows, q0, q1)
    st = scratch((i1 - i0) * (b - a), dt, tiles).reshape(b - a, i1 - i0)  # the tile, transposed
    np.matmul(kk[a:b], qs[i0:i1].T, out=st)        # (w,D) @ (D,r) -> (w,r)
    mi = None if m is None else m[i0:i1]
    if mods is not None:                           # softcap, masks, exp, Σ and dropout (.modifiers)
        modifiers.bound_tile(mods, st, mi, l[i0:i1], spec, heads, rows, a, b, None if keys is None else keys.rows(i0, i1))
        acc[i0:i1] += st.T @ vv[a:b]
        return
    if partial_ and len(heads) == 1 and structural(spec) and \
            pow2.band_sub_exp2(st, np.zeros(i1 - i0, dt) if mi is None else mi, a, r0,
                               spec.shift(batch_of(spec, heads[0])), *spec.band, l=l[i0:i1]):
        acc[i0:i1] += st.T @ vv[a:b]               # a diagonal masked inside the exponential's pass
        return
    if partial_ or spec.alibi is not None:
        mask_and_bias(st, spec, heads, r0, r1, a, b, partial_)
    pow2.sub_exp2(st, mi, l[i0:i1])                # exp(s_ij - m_i) <= 2^C, and Σ_j, in one pass
    acc[i0:i1] += st.T @ vv[a:b]                   # (r,w) @ (w,Dv) -> (r,Dv): Σ p v


def _stacked_rows(qs, rows, q0: int, q1: int) -> tuple[int, int]:
    """The rows of ``qs`` a tile's ``rows = (r0, r1, partial)`` are: all stacked heads, or a row block."""
    r0, r1, _ = rows
    return (0, qs.shape[0]) if (r0, r1) == (q0, q1) else (r0 - q0, r1 - q0)


def run(qs, kk, vv, m, acc, l, spec, heads, q0, q1, pieces, dt, tiles, mods=None, keys=None) -> None:
    """A task's tiles ``pieces`` (``(a, b, rows)`` each), in order, as :func:`tile` makes them:
    each run of tiles the compiled call takes in one call, the others one by one."""
    plan = _plan(qs, vv, spec, heads, q0, q1, pieces, dt, mods)
    n = 0
    while n < len(pieces):
        if plan is None or not plan[2][n]:   # e.g. a product NumPy makes as matrix-vector (a causal task's first key)
            a, b, rows = pieces[n]
            tile(qs, kk, vv, m, acc, l, spec, heads, q0, q1, a, b, rows, dt, tiles, mods, keys)
            n += 1
            continue
        mod, table, takes = plan
        e = n + 1
        while e < len(pieces) and takes[e]:
            e += 1
        lo, hi = spec.band
        area = int(((table[n:e, 1] - table[n:e, 0]) * (table[n:e, 3] - table[n:e, 2])).max())
        mod.bound_task(mod.ADDR, qs, kk, vv, np.zeros(qs.shape[0], np.float32) if m is None else
                       np.ascontiguousarray(m, np.float32), acc, l, table[n:e],
                       spec.shift(batch_of(spec, heads[0])) if table[n:e, 5].any() else 0,
                       _FAR if lo is None else lo, _FAR if hi is None else hi, scratch(area, np.float32, tiles),
                       np.empty_like(acc))
        n = e


def _plan(qs, vv, spec, heads, q0, q1, pieces, dt, mods):
    """``(module, table, takes)`` for the compiled call: :mod:`.task_compiled`'s rows ``(k0, k1,
    i0, i1, r0, band)``, and which tiles it computes as :func:`tile` does (every product a
    matrix product in NumPy too); None where it takes none."""
    if dt != np.float32 or mods is not None or spec.alibi is not None or min(qs.shape[1], vv.shape[1]) < 2 \
            or pow2.path() != "numba":
        return None
    mod = jit.load(jit.FLASH_TASK)
    if mod is None or not mod.ADDR[0]:
        return None
    band = len(heads) == 1 and structural(spec)
    table = np.empty((len(pieces), 6), np.int64)
    takes = np.empty(len(pieces), bool)
    for n, (a, b, rows) in enumerate(pieces):
        i0, i1 = _stacked_rows(qs, rows, q0, q1)
        if rows.partial and not band:
            return None          # a mask beside the band: every tile through the loop
        table[n] = (a, b, i0, i1, rows.r0, bool(rows.partial))
        takes[n] = b - a >= 2 and i1 - i0 >= 2
    return (mod, table, takes) if takes.any() else None


def finish(acc, l, least: float, dt) -> tuple:
    """``(acc / l, ok)``: the rows divided in float64 and rounded to ``dt`` once, and ``ok`` where
    ``l >= least`` and the row's ``acc`` and ``l`` are finite; one compiled pass for float32."""
    mod = jit.load(jit.FLASH_TASK) if dt == np.float32 and acc.flags.c_contiguous else None
    if mod is None:
        ok = (l >= least) & np.isfinite(acc).all(axis=1) & np.isfinite(l)
        return (acc / l[:, None]).astype(dt, copy=False), ok
    out, ok = np.empty(acc.shape, dt), np.empty(len(l), bool)
    mod.finish(acc, l, least, out, ok)
    return out, ok
