"""A forward task on the bound path with its Python cut to a few calls: the same bits, less GIL.

A task of the tiled forward (:mod:`.forward_kernel`) makes its rows, their offsets, the bound
path's tiles, ``acc / l``, ``lse`` and each row's checks as a dozen small NumPy operations
around one compiled call: about 0.6 ms of Python a task of 512 rows on a Zen 3, 7 % of a
(1, 8, 4096, 64) forward at one thread. At two threads that Python holds the GIL, and a
thread's tasks waited on the other's: the causal forward spent 18 % of its wall time outside
the compiled tiles, against 11 % at one thread.

Where a task can only end on the bound path, :func:`run` makes it with two more compiled
calls and few other passes: :func:`.task_compiled.scaled_rows` (the rows times
``log2(e)·scale`` and the largest row norm) and :func:`.task_compiled.finish` (``acc / l``
straight into the call's output). Its ``l`` and offsets go into arrays of the call, and
:func:`close` forms every such row's ``lse`` in one pass afterwards. It computes what
:func:`.forward_kernel._attempt` does, operation for operation:

- where every row's bound ``‖q_i‖·max‖k_j‖`` is below the headroom by a margin (2^-10 of it)
  far wider than the rounding of either norm, its offsets are 0, as ``_attempt``'s float32
  bound makes them, and every row may try (``rows_bound.may_try``); above that margin it asks
  :func:`.rows_bound.offsets` as ``_attempt`` does (scores of ±30 and more), and turns the task
  away where a row may not try;
- the tiles are :func:`.bound_tiles.run`'s (softcap and dropout as there), the division
  :func:`.bound_tiles.finish`'s, the ``lse`` :func:`.precise.lse_of` on the same offsets and sums;
- no row is redone here: :func:`run` returns False (and the caller runs ``_attempt``) where a
  row fails the bound path's test, where a result is inf, where ``q`` is not finite or its
  bound near the dtype's top; after the pass, :func:`close` hands back the tasks with a large
  row (``precise.large_rows`` on the same ``lse``), whose large rows the caller takes from the
  precise path, as ``_run_task`` does after ``_attempt``.

So a row's out and lse have the bits they had, on every thread count (``tests/attention/
test_fast_task.py``: beside ``_attempt`` on inputs that take each way out).
"""
from __future__ import annotations

import numpy as np

from ... import jit
from . import bound_tiles, rows_bound
from . import exp2 as pow2
from .precise import large_rows, lse_of
from .tiles import LOG2E

MARGIN = 1.0 - 2.0 ** -10   # of the headroom: below it every offset is 0 (module docstring)
BIG = 2.0 ** 100            # a bound beyond it (or not finite): the task goes to _attempt at once


class FastRows:
    """One call's rows made by :func:`run`: their ``l`` (float64) and offsets, which they are, and the tasks."""

    def __init__(self, mod, shape: tuple, tk: int):
        self.mod, self.tk = mod, tk
        self.l = np.zeros(shape)
        self.m = np.zeros(shape, np.float32)
        self.taken = np.zeros(shape, bool)
        self.tasks: list = []                # (task, kv head) of each


def open_rows(call, shape: tuple) -> FastRows | None:
    """A :class:`FastRows` for a forward call whose tasks may take :func:`run` (float32, the
    ``fast`` extra, the bound path allowed, no ALiBi, one head a task), else None."""
    if call.dt != np.float32 or not (call.fast and call.bound_ok) or call.stack or call.spec.alibi is not None \
            or pow2.path() != "numba":
        return None
    mod = jit.load(jit.FLASH_TASK)
    return None if mod is None or not mod.ADDR[0] else FastRows(mod, shape, call.tk)


def run(fast: FastRows, call, q, kv, task, pieces, headroom: float, loose: float, out) -> bool:
    """Task ``task`` (one head) on the bound path into ``out`` and ``fast``; False (``out``'s
    rows undefined) where the caller must run it as before. ``pieces(nrow)``: its tiles."""
    h, q0, q1 = task.heads[0], task.q0, task.q1
    kmax = max(float(kv.norms[a:b].max()) for a, b, _ in task.runs)
    qs = np.empty((q1 - q0, q.shape[-1]), np.float32)
    u = np.sqrt(fast.mod.scaled_rows(q[h][q0:q1], call.sc, qs)) * kmax
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        m = None
        if not u <= MARGIN * headroom:                      # offsets above 0 may be needed: _attempt's own
            if not u <= BIG:                                 # NaN, inf, or near the top: _attempt alone
                return False
            m, may = rows_bound.offsets(qs, call, kv, task, headroom, loose)
            if may is not None and not may.all():
                return False
            fast.m[h][q0:q1] = m
            m = m if m.any() else None
        acc = np.zeros((q1 - q0, kv.v.shape[-1]), np.float32)
        l = fast.l[h][q0:q1]
        bound_tiles.run(qs, kv.k, kv.v, m, acc, l, call.spec, task.heads, q0, q1, pieces(q1 - q0), call.dt,
                        call.tiles, call.mods, task.keys)
    ok = np.empty(q1 - q0, bool)
    if not (fast.mod.finish(acc, l, 2.0 ** -loose, out[h][q0:q1], ok) and ok.all()):   # an inf out: large
        l[:] = 0
        return False
    fast.taken[h][q0:q1] = True
    fast.tasks.append((task, kv))
    return True


def close(fast: FastRows, lse) -> tuple:
    """Every :func:`run` row's ``lse`` into ``lse``; ``(tasks, large)``: ``(task, kv)`` of the tasks
    with a large row and which rows are large (the precise path's, as ``_run_task`` takes them)."""
    if not fast.tasks:
        return [], None
    ls = lse_of(fast.m, fast.l, LOG2E)
    np.copyto(lse, ls, casting="same_kind", where=fast.taken)
    large = large_rows(ls, fast.tk, np.float32) & fast.taken
    if not large.any():
        return [], None
    return [(t, kv) for t, kv in fast.tasks if large[t.heads[0]][t.q0:t.q1].any()], large
