"""The tiled forward: online softmax, and a fixed offset from a bound where that is exact.

Derivation (one query row i; ``s_j = scale · q_i·k_j + bias_ij``, ``-inf`` where masked).

**Softmax with any offset.** For every finite ``m``::

    o_i = Σ_j exp(s_j - m) v_j / l,   l = Σ_j exp(s_j - m),   lse_i = m + log l

The result does not depend on ``m``; ``m`` only keeps ``exp`` in range. The classic choice
is the row maximum, which needs a pass over the scores before the exponentials.

**Online softmax.** Walking the keys in blocks ``B_1, B_2, ...`` and keeping a running
maximum ``m``, a running sum ``l`` and an unnormalised output ``acc``, a new block updates::

    m'   = max(m, max_{j∈B} s_j)
    l'   = exp(m - m') l   + Σ_{j∈B} exp(s_j - m')
    acc' = exp(m - m') acc + Σ_{j∈B} exp(s_j - m') v_j

and at the end ``o_i = acc / l``, ``lse_i = m + log l``. That is the *exact* path here.

**A fixed offset from a bound (the fast path).** By Cauchy–Schwarz,
``s_j <= U_i = scale · ‖q_i‖ · max_j ‖k_j‖``, the max over the keys row i may see
(:mod:`.rows_bound`), plus an upper bound of the ALiBi term over the task's keys. With
``m = max(0, U_i - C)`` no exponent exceeds ``C`` (about 60 in float32), so nothing overflows and
``m`` never changes: no rescaling of ``acc``, no max pass, and the row sums ``l`` are added
up in the exponential's own pass. A block then costs two matrix products and one in-place
``exp``. The bound may be loose;
float32 keeps full relative precision for ``exp(x)`` down to ``x ≈ -87``, so the result
is exact to rounding as long as the largest term is not tiny: rows whose ``l < e^-40``
(including rows that see nothing) are redone on the exact path, and so are rows whose
``acc`` overflowed (terms up to ``2^C`` times values near the top of the dtype's range).

**Base 2.** ``exp(s - m) = 2^(log2(e)·s - log2(e)·m)``: q is scaled by ``log2(e)·scale``
once, offsets and ``lse`` are kept in base 2 inside the kernel, and the tiles need
``2^(s - m)``: one pass of :mod:`.exp2` (compiled with the ``fast`` extra, else NumPy's
fastest exponential on the CPU). ``lse = (m + log2 l) · ln 2`` is formed in float64 and
rounded once.

**Masked diagonals.** Where a causal or window diagonal crosses a task's key chunk, the
bound path takes the masked keys by row blocks of ``Tiles.diagonal_rows`` (128), each over
only the keys it may see: a 512-row causal diagonal then costs 5/8 of its square.

**Large scores: the precise path.** Scores of size ``|s|`` carry a rounding error of about
``eps·|s|`` in the compute dtype, and a float32 ``lse`` an error of half its ulp. Where a
row's ``lse`` says its largest score is beyond ``±LARGE`` (:func:`large_rows`: 16, beyond
``log Tk`` on the high side; ordinary attention stays inside), the row is redone by the
online softmax with the scores ``(Q Kᵀ)·scale`` and the offsets in float64 and natural
units (:func:`_fwd_precise`); each ``s - m <= 0`` is rounded to the compute dtype only
before its exponential (float32 with the ``fast`` extra: ``(s - m)·log2(e)`` in float64,
rounded once, and the compiled ``2^x``: :func:`~.precise.exp_shifted`). For float32 input the
scores are then exact far below what float32 shows; for float64 input it is the dense path's
arithmetic, without base-2 roundings. A bias
such as ``finfo(float32).min`` (Hugging Face's mask value) neither overflows there nor hides
the row's other terms; on the fast path it is clipped (:func:`~.tiles.bias_limit`), which
changes nothing unless a row sees only such keys, and such a row is large. A row that sees
nothing is one the *mask* empties (``-inf`` or a structural mask), never one whose finite
scores are merely large. The bound path is not tried by a row that could pass it only as a
large row. The backward applies the same test to the saved ``lse`` to choose its precise,
self-normalised path.

**Row by row.** A row's result depends on its own query and the keys it may see, to the bit:
its offset is its own, and each path is computed for all of a task's rows (a product keeps
its shape, so each row gets the same bits whatever the others hold) while each row takes
its own path's result: the bound path where it may try it and passes, else the exact one,
and the precise one where it is large (:func:`_attempt`, :func:`_run_task`). A task where
one row fails so costs the exact path beside the bound one, as a whole-task fallback did.

**The code.** :func:`forward` fixes a :class:`Call`, prepares each kv head (:class:`KVHead`)
and runs one :class:`Task` per block of query rows: :func:`_attempt` (the bound path, else the
exact one, row by row), and for its large rows, :func:`_precise`. A float32 task that can only
end on the bound path is made by :mod:`.fast_task` instead, with the same bits and less Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from ...errors import ShapeError
from ...masks import MaskSpec
from . import exp2 as pow2
from . import bound_tiles, fast_task, modifiers, products, rows_bound
from .precise import LARGE, exp_shifted, large_rows, later_scale, lse_of
from .tiles import (DEFAULT, LOG2E, Rows, Tiles, Workers, batch_of, bias_limit, by_batch, chunks,
                    diagonal_pieces, kv_heads, mask_and_bias, scratch, task_rows)

# Base-2 exponent headroom C, and the "bound too loose" threshold: l < 2^-LOOSE.
_HEADROOM = {np.dtype(np.float32): 86.0, np.dtype(np.float64): 430.0}
_LOOSE = {np.dtype(np.float32): 58.0, np.dtype(np.float64): 290.0}


# --- the prepared operands ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Call:
    """The fixed facts of one forward call."""

    spec: MaskSpec
    scale: float
    sc: np.floating       # log2(e)·scale in the compute dtype; inf: scores in base 2 overflow it
    tk: int
    dt: np.dtype
    tiles: Tiles
    stack: bool           # fewer rows than tiles.stack_rows: a kv head's query heads stacked in one task
    bound_ok: bool        # the bound path may be tried: no bias array (it has no cheap bound), and
    #                       enough rows a task (decoding rows take the exact path alone: K read once)
    clip: float | None    # the fast paths' bias clip (see tiles.bias_limit)
    stop2: float          # in base 2: a row maximum beyond it is large (see large_rows)
    fast: bool            # sc is finite: the compute-dtype paths may be tried (else the precise path alone)
    mods: modifiers.Mods | None   # softcap and dropout (qkv.score_ops), None where the scores are plain


@dataclass(frozen=True, slots=True)
class KVHead:
    k: np.ndarray              # (Tk, D) contiguous
    v: np.ndarray              # (Tk, Dv) contiguous
    norms: np.ndarray | None   # (Tk,) ‖k_j‖ where the bound path may run (read inside kv_lengths only)


@dataclass(slots=True)
class Task:
    """Query rows ``q0:q1`` of the query heads ``heads`` (one kv head, one batch item; stacked
    head after head) against the key runs ``(a, b, full)`` they see (:meth:`MaskSpec.segments`)."""

    heads: list
    q0: int
    q1: int
    runs: list
    keys: modifiers.Keys | None = None   # the rows' dropout keys (stacked), where dropout is on

    @property
    def span(self) -> tuple[int, int]:
        """The keys from the first run's start to the last run's end."""
        return self.runs[0][0], self.runs[-1][1]


def _setup(q, k, spec: MaskSpec, scale: float, group: int, tiles: Tiles | None) -> Call:
    tiles = DEFAULT if tiles is None else tiles
    dt = np.dtype(q.dtype)
    tq, tk = q.shape[-2], k.shape[-2]
    stack = tq < tiles.stack_rows
    with np.errstate(over="ignore"):
        sc = dt.type(scale * LOG2E)
    rows = group * tq if stack else tq
    stop2 = (LARGE[dt] + np.log(tk)) * LOG2E
    return Call(spec, float(scale), sc, tk, dt, tiles, stack, spec.bias is None and rows >= tiles.stack_rows,
                bias_limit(spec, dt), stop2, bool(np.isfinite(sc)), modifiers.of(spec, dt))


def _prep_kv(call: Call, k, v, ikv) -> KVHead:
    kk = np.ascontiguousarray(k[ikv])                      # (Tk, D)
    vv = np.ascontiguousarray(v[ikv])                      # (Tk, Dv)
    if not call.bound_ok:
        return KVHead(kk, vv, None)
    with np.errstate(over="ignore", invalid="ignore"):     # padding may hold anything
        return KVHead(kk, vv, np.sqrt(np.einsum("td,td->t", kk, kk)))  # ‖k_j‖


def _stacked(q, task: Task, dt, factor=None) -> np.ndarray:
    """``(G·n, D)``: rows q0:q1 of each of the task's heads, head after head, times ``factor``."""
    n = task.q1 - task.q0
    qs = np.empty((len(task.heads) * n, q.shape[-1]), dt)
    with np.errstate(over="ignore"):
        for g, h in enumerate(task.heads):
            if factor is None:
                qs[g * n:(g + 1) * n] = q[h][task.q0:task.q1]
            else:
                np.multiply(q[h][task.q0:task.q1], factor, out=qs[g * n:(g + 1) * n])
    return qs


# --- the exact path: online softmax ---------------------------------------------------------------
def _fwd_exact(qs, call: Call, kv: KVHead, task: Task):
    """Online softmax over the task's key runs, in base 2 (``qs`` scaled by log2(e)·scale).
    Returns ``(out (R, Dv), m (R,), l (R,))`` (``lse = (m + log2 l) · ln 2``); a row whose
    maximum ``m`` passes ``call.stop2`` is large (the precise path redoes it)."""
    dt, nrow = call.dt, qs.shape[0]
    m = np.full(nrow, -np.inf, dt)
    l = np.zeros(nrow)                                       # float64: a float32 running sum over Tk keys erred ~√Tk ulps
    acc = np.zeros((nrow, kv.v.shape[-1]), dt)
    scores, values = products.choose(dt, nrow, call.tiles)
    for a, b, partial_ in chunks(task.runs, max(16, call.tiles.scratch // nrow)):
        st = scores(kv.k, qs, a, b, call.tiles)              # (w,D) @ (D,R) -> (w,R): the tile, transposed
        if call.mods is not None:
            modifiers.cap(call.mods, st)                     # s = c·tanh(x / c), before bias and masks
        mask_and_bias(st, call.spec, task.heads, task.q0, task.q1, a, b, partial_, LOG2E, call.clip)
        m_new = np.maximum(m, st.max(axis=0))                # m' = max(m, max_j s_j)
        m_safe = np.where(m_new == -np.inf, 0, m_new).astype(dt, copy=False)
        alpha = np.exp2(m - m_safe)                          # exp(m - m'); 0 while m = -inf
        l *= alpha
        if call.mods is None:
            pow2.sub_exp2(st, m_safe, l)                     # exp(s_j - m'); l' = alpha l + Σ exp(s_j - m')
        else:                                                # the same, then times keep / (1 - p) with dropout
            modifiers.exp_sum_drop(call.mods, st, m_safe, l, task.keys, call.spec.k_start + a)
        acc *= alpha[:, None]
        values(st, kv.v, a, b, acc, call.tiles)              # acc' = alpha acc + Σ exp(s_j - m') v_j
        m = m_new
    seen = l != 0  # l = 0: the row saw nothing; l = NaN (a NaN input) stays NaN, as in the reference
    return (acc / np.where(seen, l, 1)[:, None]).astype(dt, copy=False), m, l


# --- the precise path: float64 scores in natural units -------------------------------------------
def _fwd_precise(q64, k64, call: Call, kv: KVHead, task: Task):
    """The online softmax with the scores and offsets in float64 and natural units: ``q64``
    (stacked, unscaled) and ``k64`` are float64, ``kv.v`` in the compute dtype. ``s - m``
    (at most 0) is rounded to the compute dtype before the exponential
    (:func:`~.precise.exp_shifted`), so the terms and sums cost what the exact path's do.
    Returns ``(out (R, Dv), m (R,) float64, l (R,))``."""
    dt, nrow = call.dt, q64.shape[0]
    m = np.full(nrow, -np.inf)
    l = np.zeros(nrow)
    acc = np.zeros((nrow, kv.v.shape[-1]), dt)
    f = later_scale(call.scale, call.mods is None and call.spec.bias is None and call.spec.alibi is None)
    for a, b, partial_ in chunks(task.runs, max(16, call.tiles.scratch // nrow)):
        s64 = scratch(nrow * (b - a), np.float64, call.tiles, 1).reshape(b - a, nrow)
        np.matmul(k64[a:b], q64.T, out=s64)                  # (w,D) @ (D,R) -> (w,R), float64
        if f == 1.0:
            s64 *= call.scale                                # scaled after the sum, as the dense path does
        if call.mods is not None:
            modifiers.cap(call.mods, s64, 1.0)               # s = c·tanh(x / c), in float64
        mask_and_bias(s64, call.spec, task.heads, task.q0, task.q1, a, b, partial_, 1.0)
        m_new = np.maximum(m, s64.max(axis=0) * f)           # m' = max(m, max_j s_j)
        m_safe = np.where(m_new == -np.inf, 0, m_new)
        alpha = np.exp(m - m_safe)                           # exp(m - m'); 0 while m = -inf
        st = scratch(nrow * (b - a), dt, call.tiles).reshape(b - a, nrow)
        l *= alpha
        exp_shifted(s64, m_safe, st, f=f, l=l)               # exp(s_j - m'); l' = alpha l + Σ exp(s_j - m')
        if task.keys is not None:
            modifiers.drop(call.mods, st, task.keys, call.spec.k_start + a)   # times keep / (1 - p)
        acc *= alpha[:, None].astype(dt)
        acc += st.T @ kv.v[a:b]                              # (R,w) @ (w,Dv) -> (R,Dv)
        m = m_new
    seen = l != 0
    return acc / np.where(seen, l, 1)[:, None].astype(dt), m, l


# --- the fast path: a fixed offset from the bound -------------------------------------------------
def _fwd_bound(qs, call: Call, kv: KVHead, task: Task, m):
    """Fixed offsets ``m = max(0, U - C)`` from the Cauchy–Schwarz bound (:mod:`.rows_bound`).
    Returns ``(out (R, Dv), m (R,), l (R,), ok (R,))`` in base 2; ``ok`` False on the rows
    that need the exact path."""
    dt, nrow, spec, heads, q0, q1 = call.dt, qs.shape[0], call.spec, task.heads, task.q0, task.q1
    offset = m if m.any() else None                          # m = 0: no subtraction
    acc = np.zeros((nrow, kv.v.shape[-1]), dt)
    l = np.zeros(nrow)                                       # float64: a float32 running sum over Tk keys erred ~√Tk ulps
    bound_tiles.run(qs, kv.k, kv.v, offset, acc, l, spec, heads, q0, q1, _pieces(call, task, nrow), dt, call.tiles,
                    call.mods, task.keys)
    # ok: else a row's largest term is tiny (or it sees nothing), or terms up to 2^C times large values overflowed
    out, ok = bound_tiles.finish(acc, l, 2.0 ** -_LOOSE[dt], dt)
    return out, m, l, ok


def _pieces(call: Call, task: Task, nrow: int) -> list:
    """The bound path's tiles ``(a, b, Rows)`` of a task of ``nrow`` stacked rows: key chunks, a
    masked diagonal of one head by row blocks (each computes only the keys it sees)."""
    q0, q1 = task.q0, task.q1
    split = len(task.heads) == 1 and call.spec.mask is None and nrow > call.tiles.diagonal_rows
    pieces = []
    for a, b, partial_ in chunks(task.runs, max(16, call.tiles.scratch // nrow)):
        if split and partial_:
            pieces += diagonal_pieces(call.spec, task.heads[0], q0, q1, a, b, partial_, call.tiles.diagonal_rows)
        else:
            pieces.append((a, b, Rows(q0, q1, partial_)))
    return pieces


# --- a task: the fast paths, else the precise one, row by row ---------------------------------------
def _attempt(call: Call, q, kv: KVHead, task: Task):
    """The compute-dtype attempt: ``(out, lse float64, large (R,))``, each row from the bound
    path where it may try it and passes, else from the exact one; ``large``: the rows that
    must go precise (``log2(e)·scale·q`` overflowed, a row maximum or lse is large, out is inf).
    Each path is computed for all the task's rows (the products keep their shapes, so a
    row's bits are its own) and each row takes its own path's result."""
    qs = _stacked(q, task, call.dt, call.sc)                 # (G·n, D), scaled by log2(e)·scale
    over = np.isinf(qs).any(axis=1)
    res, ok = None, None
    if kv.norms is not None:
        # overflow (and inf - inf inside the product, which some BLAS kernels report as
        # invalid) is detected there and the rows redone exactly: no warning escapes
        with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
            m, may = rows_bound.offsets(qs, call, kv, task, _HEADROOM[call.dt], _LOOSE[call.dt])
            if may is None or may.any():
                *res, ok = _fwd_bound(qs, call, kv, task, m)
                ok = ok if may is None else ok & may
    big = False
    if ok is None or not ok.all():
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            exact = _fwd_exact(qs, call, kv, task)
        took = True if ok is None else ~ok                   # the rows that take the exact path
        big = took & (exact[1] > call.stop2)                 # ... and whose maximum is large
        res = exact if ok is None else [np.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)), r, x)
                                        for r, x in zip(res, exact)]
    o, m, l = res
    ls = lse_of(m, l, LOG2E)
    large = large_rows(ls, call.tk, call.dt)
    large |= over | big
    large |= np.isinf(o).any(axis=1)
    return o, ls, large


def _precise(call: Call, q, kv: KVHead, task: Task):
    """Scores in float64 and natural units (see the module docstring): ``(out, lse float64)``."""
    lo, hi = task.span
    k64 = np.empty((call.tk, q.shape[-1]))
    k64[lo:hi] = kv.k[lo:hi]                                 # the visible span only: no other row is read
    with np.errstate(under="ignore"):
        o, m, l = _fwd_precise(_stacked(q, task, np.float64), k64, call, kv, task)
    return o, lse_of(m, l, 1.0)


def _run_task(call: Call, q, kv: KVHead, heads: list, q0: int, q1: int, out, lse, fast=None) -> None:
    """Rows q0:q1 of ``heads``, written into ``out`` and ``lse`` (``lse`` later, by
    :func:`.fast_task.close`, where ``fast`` made the task)."""
    b = batch_of(call.spec, heads[0])
    q1 = min(q1, call.spec.rows(b))  # rows past q_lengths[b] are padding: never read, out 0
    runs = call.spec.segments(q0, q1, 0, call.tk, batch=b)
    if not runs:
        return  # no key visible: out 0, lse -inf as initialised
    task = Task(heads, q0, q1, runs, modifiers.task_keys(call.mods, heads, q0, q1))
    if fast is not None and fast_task.run(fast, call, q, kv, task, partial(_pieces, call, task),
                                          _HEADROOM[call.dt], _LOOSE[call.dt], out):
        return
    if not call.fast:
        o, ls = _precise(call, q, kv, task)
    else:
        o, ls, large = _attempt(call, q, kv, task)
        if large.any():                                      # the precise path for the whole task, taken
            po, pls = _precise(call, q, kv, task)            # by its large rows only
            o[large], ls[large] = po[large], pls[large]
    n = q1 - q0
    for g, h in enumerate(heads):
        out[h][q0:q1] = o[g * n:(g + 1) * n]
        lse[h][q0:q1] = ls[g * n:(g + 1) * n]


def _precise_rows(call: Call, q, kv: KVHead, task: Task, rows, out, lse) -> None:
    """A :mod:`.fast_task` task's large ``rows`` from the precise path, as :func:`_run_task` does."""
    o, ls = _precise(call, q, kv, task)
    h = task.heads[0]
    out[h][task.q0:task.q1][rows] = o[rows]
    lse[h][task.q0:task.q1][rows] = ls[rows]


# --- the call ------------------------------------------------------------------------------------
def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            *, tiles: Tiles | None = None, num_threads: int | None = None, lse_dtype=None):
    """Tiled exact attention; the kernel interface of :func:`qkv.kernels.reference.forward`.

    ``tiles`` (default :class:`Tiles`) and ``num_threads`` (default
    :func:`qkv.get_num_threads`) hold for this call only. ``lse_dtype=np.float64`` keeps
    lse as the kernel forms it, unrounded (for a caller that merges partial results: the ring).
    Returns ``(out (*L,Tq,Dv), lse (*L,Tq), None)``; weights are never made here.
    """
    if return_weights:
        raise ShapeError("the tiled kernel does not make weights; use method='reference' for them")
    call = _setup(q, k, spec, scale, group, tiles)
    tq, dv = q.shape[-2], v.shape[-1]
    out = np.zeros(spec.lead + (tq, dv), call.dt)
    lse = np.full(spec.lead + (tq,), -np.inf, call.dt if lse_dtype is None else lse_dtype)
    heads_of = list(kv_heads(k.shape[:-2], group))
    fast = fast_task.open_rows(call, spec.lead + (tq,))
    with Workers(num_threads, int(np.prod(spec.lead)) * tq * call.tk, call.tiles) as pool:
        kvs = pool.run([partial(_prep_kv, call, k, v, ikv) for ikv, _ in heads_of])
        pool.run(_jobs(call, q, heads_of, kvs, out, lse, fast))
        if fast is not None:    # the fast tasks' lse in one pass, their large rows from the precise path
            again, large = fast_task.close(fast, lse)
            pool.run([partial(_precise_rows, call, q, kv, t, large[t.heads[0]][t.q0:t.q1], out, lse)
                      for t, kv in again])
    return out, lse, None


def _jobs(call: Call, q, heads_of: list, kvs: list, out, lse, fast=None) -> list:
    """The (heads, query block) tasks of every kv head, late rows first."""
    tq = q.shape[-2]
    rows = tq if call.stack else task_rows(call.tiles.rows, tq, int(np.prod(call.spec.lead)))
    jobs = []
    for (ikv, hs), kv in zip(heads_of, kvs):
        groups = by_batch(call.spec, hs) if call.stack else [[h] for h in hs]
        for heads in groups:
            for q0 in range(0, tq, rows):
                jobs.append(partial(_run_task, call, q, kv, heads, q0, min(q0 + rows, tq), out, lse, fast))
    jobs.reverse()  # causal: the late rows see the most keys; start them first
    return jobs
