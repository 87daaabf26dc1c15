"""The tiled backward: gradients from the saved ``out`` and ``lse``, P recomputed tile by tile.

**Backward.** With ``P = exp(S - lse)`` (recomputed tile by tile, never stored) and
``dO = ∂L/∂O``::

    dV = Pᵀ dO
    dP = dO Vᵀ
    dS = P ∘ (dP - delta + dlse),   delta_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i)
    dQ = scale · dS K,       dK = scale · dSᵀ Q

(the softmax Jacobian ``diag(p) - p pᵀ`` applied row by row gives ``dS``; ``delta`` is a
row of ``O`` against a row of ``dO``, so it needs no tile). Both subtractions ride in the
products as extra columns: ``S - lse = [scale·Q | -hi | -lo] [K | 1 | 1]ᵀ`` (in base 2, with
``log2(e)·lse = hi + lo`` split exactly into two floats, so no rounding of the large
``log2(e)·lse`` enters) and ``dP - delta + dlse = [dO | dlse - delta] [V | 1]ᵀ`` (``dlse``, the
gradient of lse where the loss uses it, else 0), so a tile is five
products, one ``exp`` and one multiply. Every allowed ``s_ij <= lse_i``, so ``P <= 1``
never overflows; a row that saw nothing (``lse = -inf``) gets a zero row of
``[dO | -delta]`` and so zero gradients.

**Large scores: the precise path, normalised by the row's own sums.** A saved float32
``lse`` is only within half an ulp of the true one: at ``|lse| = 1e4`` that is ``5e-4``, and
every ``P`` of the row would be off by that factor. Where a row's scores are all near a huge
bias (``-1e30``), ``lse = m + log l`` cannot even hold ``log l`` (it rounds to ``m``) and
``exp(S - lse)`` would give every key ``P = 1``. And a recomputed score differs from the
forward's by about eps times the size of its terms: where one key dominates a row, its
``P`` should be exactly 1. So rows that the forward's test calls large
(:func:`~.precise.large_rows`) or whose terms may be large
(``scale·‖q_i‖·max‖k_j‖ > TERMS``, the max over the keys row i may see) are chosen by
:func:`~.precise.own_precise_rows`; their scores
``x = (Q Kᵀ)·scale + bias`` are formed in float64 and natural units, and they are
normalised without ``lse``: a first pass over exactly the same tiles (the same products, so
the same bits) finds the row maximum ``m_i`` and ``l_i = Σ_j exp(x_ij - m_i)``
(:func:`row_sums`, a running maximum, so nothing overflows), and the second uses
``P = exp((x - m) - log l)``, the two subtractions apart so that ``log l`` survives beside a
huge ``m``, rounded to the compute dtype before the exponential (:func:`~.precise.exp_shifted`:
float32 with the ``fast`` extra in base 2, the exponent rounded once). Rows of ``P`` then sum to 1
to rounding whatever ``lse`` was saved, and a row with one dominant key gets ``P = 1`` for it
exactly. Only the score tile of those rows costs float64 (a tile with other rows too is
computed both ways, each row taking its own); the other four products stay in the compute dtype.

**Keys in several calls (ring attention).** ``m`` and ``l`` are sums over *every* key of
the row. A caller that holds the keys in blocks (the ring) chooses the precise rows once
for the whole sequence (:func:`precise_rows` with the global ``max‖k_j‖``), adds up
:func:`row_sums` over all blocks with :meth:`RowNorm.merge`, and hands both to
:func:`backward` for each block (``precise=``, ``norm=``); a block alone would normalise P
by the part of the row it sees.

**Rows with one dominant key: delta from their own tiles.** Where key r holds nearly all
of row i (``P_ir = 1 - ε``), the true ``dP_ir - delta_i = Σ_{j≠r} P_ij (dP_ir - dP_ij)`` is
of size ``ε·|dP|``, while ``dP_ir`` and ``delta_i = rowsum(dO_i ∘ O_i)`` are each of size
``|dP|`` and carry their own roundings (``O`` from the forward's, ``dP`` from a tile's
product): their difference keeps ``eps·|dP|`` of noise, which swamps ``dS_ir`` once ``ε <
eps`` (dQ erred 10⁴ of its largest entry in float32, 10⁻⁵ in float64, where dense torch
errs 0.8 and 5·10⁻⁶). The cure is the delta of the P and dP the tiles compute: with
``d_ij = dP_ij - delta_i`` as a tile forms it (``[dO | -delta] [V | 1]ᵀ``) and the residual
``c_i = Σ_j P_ij d_ij`` over every key (float64 sums of the tiles' own products), ::

    delta'_i = delta_i + c_i,   dP_ij - delta'_i = d_ij - c_i
    dP_ir - delta'_i = d_ir (1 - P_ir) - Σ_{j≠r} P_ij d_ij

in which ``d_ir`` (itself only ``eps·|dP|``, as ``delta_i ≈ dP_ir``) is multiplied by ``ε``
and every other term carries its own small ``P_ij``: nothing of size ``|dP|`` cancels
(``Σ_j P_ij (dP_ij - delta'_i) = 0`` to rounding, the identity the dense path holds). A tile
holding a whole row already does this within the tile (below, in :func:`_plain_grad_tile`).
Rows whose keys span several tiles or calls need every tile's ``c`` first: a pass that
computes the tiles' P and ``d`` (two of the five products, one ``exp``) and sums ``P ∘ d``
(:func:`delta_residual`), run only for the precise rows where one key holds all but
``PEAKED`` of the weight (``l_i - 1 < PEAKED``: ``P_max = 1/l``), where the cancellation
costs more than 16x the rounding; the main pass then subtracts ``c_i`` from ``d``. Those
rows' dQ and dK change bits; dV and every other row keep theirs. Softcap and dropout
scores keep ``delta`` from ``O``.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ...masks import MaskSpec
from . import exp2 as pow2
from . import modifiers
from .precise import RowNorm, exp_shifted, own_precise_rows, take_rows
from .precise import offsets as precise_offsets
from .operands import Call, KVHead, QueryHead, prep_kv, prep_q
from .tiles import (DEFAULT, LOG2E, Task, Tiles, Workers, batch_of, bias_limit, chunks, deal, kv_heads,
                    mask_and_bias, scratch)

F64 = np.dtype(np.float64)
PEAKED = 1 / 16   # a precise row whose l - 1 is below this takes delta from its own tiles


# --- tiles -------------------------------------------------------------------------------------
def _walk(call: Call, task: Task, qheads: dict):
    """Every tile of a task: ``(h, q0, q1, a, e, partial, precise, whole)``; ``whole`` when the
    tile holds every key its rows may see (the task spans all keys, the tile all of its runs)."""
    spec, rows = call.spec, call.tiles.bwd_rows
    all_keys = call.whole_rows and task.c0 == 0 and task.c1 == call.tk
    for h in task.heads:
        b = batch_of(spec, h)
        r0, r1 = spec.query_range(task.c0, task.c1, batch=b)
        for q0 in range(r0, r1, rows):
            q1 = min(q0 + rows, r1)
            precise = bool(qheads[h].precise[q0:q1].any())
            tiles = list(chunks(spec.segments(q0, q1, task.c0, task.c1, batch=b), task.c1 - task.c0))
            whole = all_keys and len(tiles) == 1
            for a, e, partial_ in tiles:
                yield h, q0, q1, a, e, partial_, precise, whole


def _exact_tile(call: Call, k64, q64, h, q0, q1, a, e, partial_, g=None) -> np.ndarray:
    """``xᵀ = (scale · Q Kᵀ + bias)ᵀ / f`` of a tile in float64 and natural units, masked (the
    same bits each call), ``(keys, rows)``; ``f = call.later``: the scale its consumers apply."""
    x = scratch((q1 - q0) * (e - a), F64, call.tiles, 2).reshape(e - a, q1 - q0)
    np.matmul(k64[a:e], q64[q0:q1].T, out=x)                      # (w,D) @ (D,r) -> (w,r): (Q Kᵀ)ᵀ
    if call.later == 1.0:
        x *= call.scale                                           # scaled after the sum, as the dense path does
    if call.mods is not None:
        modifiers.cap(call.mods, x, 1.0, g)                       # c·tanh(x / c); g = 1 - tanh² if given
    if partial_ or call.masked:
        mask_and_bias(x, call.spec, [h], q0, q1, a, e, partial_, 1.0)
    return x


def _sums_lane(call: Call, tasks: list, kvs: dict, qheads: dict, norm: RowNorm) -> None:
    """First pass of the precise rows: running max ``m`` and ``Σ exp(x - m)`` per row."""
    dt = call.dt

    def tile_sum(x, safe):
        p = scratch(x.size, dt, call.tiles, 0).reshape(x.shape)
        total = np.zeros(x.shape[1])
        exp_shifted(x, safe, p, f=call.later, l=total)            # exp(x - m), x - m <= 0, and its sums
        return total

    with np.errstate(under="ignore"):
        for task in tasks:
            for h, q0, q1, a, e, partial_, precise, _ in _walk(call, task, qheads):
                if precise:
                    x = _exact_tile(call, kvs[task.ikv].k64, qheads[h].q64, h, q0, q1, a, e, partial_)
                    norm.add(h, slice(q0, q1), x.max(axis=0) * call.later, partial(tile_sum, x))


def _grad_tile(call: Call, kv: KVHead, qh: QueryHead, offsets, h, q0, q1, a, e, partial_, precise, whole):
    """Pᵀ and dSᵀ of one tile, ``(keys, rows)`` each (scratch buffers), and the rows'
    ``[dO | -delta]`` they were made with (divided by P's row sums on a whole tile); where
    only some rows are precise, both paths, each row taking its own (:func:`take_rows`)."""
    tile = _plain_grad_tile if call.mods is None else _mod_grad_tile
    rows = qh.precise[q0:q1]
    if not precise or rows.all():
        return tile(call, kv, qh, offsets, h, q0, q1, a, e, partial_, precise, whole)
    with np.errstate(invalid="ignore"):   # the precise rows' columns, here without their offsets, are dropped
        fast = [x.copy() for x in tile(call, kv, qh, offsets, h, q0, q1, a, e, partial_, False, whole)]
    return take_rows(rows, fast, tile(call, kv, qh, offsets, h, q0, q1, a, e, partial_, True, whole))


def _plain_grad_tile(call: Call, kv: KVHead, qh: QueryHead, offsets, h, q0, q1, a, e, partial_, precise, whole):
    """:func:`_grad_tile` of plain scores, one path for all the tile's rows."""
    w = e - a
    et = scratch((q1 - q0) * w, call.dt, call.tiles, 0).reshape(w, q1 - q0)
    dob = qh.dox[q0:q1]
    if precise:
        x = _exact_tile(call, kv.k64, qh.q64, h, q0, q1, a, e, partial_)
        # P = exp((x - m) - log l), log l apart so that it survives a huge m, and P's row sums
        r = np.zeros(q1 - q0) if whole else None                  # (rows the lse normalised: see below)
        exp_shifted(x, offsets[0][h][q0:q1], et, offsets[1][h][q0:q1], call.later, r)
    else:
        np.matmul(kv.kx[a:e], qh.qx[q0:q1].T, out=et)             # (w,D+2) @ (D+2,r) -> (w,r): (S - lse)ᵀ
        if partial_ or call.masked:
            mask_and_bias(et, call.spec, [h], q0, q1, a, e, partial_, LOG2E, call.clip)
        r = np.zeros(q1 - q0) if whole else None
        if whole:
            pow2.sub_exp2(et, None, r)                            # P = exp(S - lse), r_i = Σ_j P_ij
        else:
            pow2.exp2(et)                                         # P = exp(S - lse)
    if whole:
        # A float32 lse is only within half an ulp, so P = exp(S - lse) is off by up to that
        # factor per row (dV erred 3-4x the dense path's). A tile that holds the whole row
        # divides P by its row sum r, as the dense path does, by way of [dO | -delta] / r.
        dob = (dob / np.where(r > 0, r, 1)[:, None]).astype(call.dt, copy=False)
    dst = scratch((q1 - q0) * w, call.dt, call.tiles, 1).reshape(w, q1 - q0)
    np.matmul(kv.v1[a:e], dob.T, out=dst)                         # (w,Dv+1) @ (Dv+1,r): dP - delta
    if whole:
        # delta from this P, not from the saved out: out came from the forward's roundings of
        # P, and the mismatch left Σ_j dS_ij != dlse_i (dQ erred 3x). With dst = (dP - delta +
        # dlse)/r and et = r·P, c_i = Σ_j et·dst = Σ_j P_ij dP_ij - delta_i + dlse_i, and
        # delta_i + (c_i - dlse_i) is this P's delta: subtract (c_i - dlse_i)/r_i.
        c = np.einsum("wr,wr->r", et, dst, dtype=np.float64)
        if qh.dlse is not None:
            c -= qh.dlse[q0:q1]
        dst -= (c / np.where(r > 0, r, 1)).astype(call.dt)
    elif precise and qh.resid is not None:
        dst -= qh.resid[q0:q1].astype(call.dt)                    # d - c: delta from the tiles' own P, dP
    dst *= et                                                     # dS = P ∘ (dP - delta)
    return et, dst, dob


def _mod_grad_tile(call: Call, kv: KVHead, qh: QueryHead, offsets, h, q0, q1, a, e, partial_, precise, whole):
    """:func:`_grad_tile` with softcap or dropout: ``((P ∘ Z)ᵀ, dXᵀ, [dO | -delta])`` (see .modifiers)."""
    w, n = e - a, q1 - q0
    et = scratch(n * w, call.dt, call.tiles, 0).reshape(w, n)
    g = scratch(n * w, call.dt, call.tiles, 3).reshape(w, n) if call.mods.cap is not None else et
    z = scratch(n * w, call.dt, call.tiles, 4).reshape(w, n)
    if precise:
        x = _exact_tile(call, kv.k64, qh.q64, h, q0, q1, a, e, partial_, g if call.mods.cap is not None else None)
        r = np.zeros(n) if whole else None
        exp_shifted(x, offsets[0][h][q0:q1], et, offsets[1][h][q0:q1], call.later, r)   # P = exp((x - m) - log l)
        if call.mods.cap is not None:
            g *= et                                               # P ∘ (1 - tanh²) (see modifiers.grad_scores)
        if qh.keys is not None:
            modifiers.keep_tile(call.mods, qh.keys.rows(q0, q1), call.spec.k_start + a, w, z)
    else:
        r = modifiers.grad_probs(call, kv, qh, h, q0, q1, a, e, partial_, whole, et, g, z)
    dob = qh.dox[q0:q1]
    if whole:  # P divided by its row sums by way of [dO | -delta] / r, as in _grad_tile
        dob = (dob / np.where(r > 0, r, 1)[:, None]).astype(call.dt, copy=False)
    dst = scratch(n * w, call.dt, call.tiles, 1).reshape(w, n)
    return modifiers.grad_scores(call, kv, qh, et, g, z, dst, dob, whole, r, q0, q1, a, e), dst, dob


def _grad_lane(call: Call, tasks: list, kvs: dict, qheads: dict, offsets, dq, dk, dv) -> None:
    """dK, dV of each task's keys from all its query heads; dQ added into this lane's ``dq``."""
    d, dvw = dk.shape[-1], dv.shape[-1]
    with np.errstate(over="ignore", under="ignore"):
        for task in tasks:
            kv = kvs[task.ikv]
            dk_loc = np.zeros((task.c1 - task.c0, d), call.dt)
            dv_loc = np.zeros((task.c1 - task.c0, dvw), call.dt)
            for h, q0, q1, a, e, partial_, precise, whole in _walk(call, task, qheads):
                qh = qheads[h]
                et, dst, dob = _grad_tile(call, kv, qh, offsets, h, q0, q1, a, e, partial_, precise, whole)
                dv_loc[a - task.c0:e - task.c0] += et @ dob[:, :dvw]      # (w,r) @ (r,Dv): dV += Pᵀ dO
                dk_loc[a - task.c0:e - task.c0] += dst @ qh.q[q0:q1]      # (w,r) @ (r,D): dK += dSᵀ Q
                dq[h][q0:q1] += dst.T @ kv.kx[a:e, :d]                    # (r,w) @ (w,D): dQ += dS K
            dk_loc *= call.dt.type(call.scale)                            # dK = scale · dSᵀ Q
            dk[task.ikv][task.c0:task.c1] = dk_loc
            dv[task.ikv][task.c0:task.c1] = dv_loc


# --- the calls ---------------------------------------------------------------------------------
def _setup(q, k, spec, scale, group, tiles, num_threads, whole_rows=True):
    tiles = DEFAULT if tiles is None else tiles
    dt = np.dtype(q.dtype)
    call = Call(spec, float(scale), k.shape[-2], dt, tiles, whole_rows, spec.bias is not None or spec.alibi is not None,
                bias_limit(spec, dt), modifiers.of(spec, dt))
    work = int(np.prod(spec.lead)) * q.shape[-2] * k.shape[-2]
    return call, Workers(num_threads, work, tiles), list(kv_heads(k.shape[:-2], group))


def _sums_pass(pool, call, lanes, kvs, qheads, shape) -> RowNorm:
    """``m``, ``l`` of the precise rows over this call's keys, from per-lane sums merged in a
    fixed order."""
    norms = [RowNorm.empty(shape) for _ in lanes]
    pool.run([partial(_sums_lane, call, lane, kvs, qheads, norms[i]) for i, lane in enumerate(lanes)])
    total = norms[0]
    for other in norms[1:]:
        total = total.merge(other)
    return total


def row_sums(q, k, spec: MaskSpec, scale: float, group: int, precise: np.ndarray, *,
             tiles: Tiles | None = None, num_threads: int | None = None) -> RowNorm:
    """The precise rows' ``m`` and ``l`` over the keys ``k`` of this call (other rows: ``m =
    -inf``, ``l = 0``); add up several calls' with :meth:`RowNorm.merge`."""
    call, workers, heads_of = _setup(q, k, spec, scale, group, tiles, num_threads)
    with workers as pool:
        kvs = {ikv: prep_kv(call, ikv, k, None, True, sums_only=True) for ikv, _ in heads_of}
        qheads = {h: prep_q(call, h, q, precise) for _, hs in heads_of for h in hs}
        lanes = deal(spec, heads_of, k.shape[-2], pool.n, call.tiles)
        return _sums_pass(pool, call, lanes, kvs, qheads, q.shape[:-1])


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1,
             *, tiles: Tiles | None = None, num_threads: int | None = None,
             precise: np.ndarray | None = None, norm: RowNorm | None = None, blocks: bool = False,
             dlse: np.ndarray | None = None, resid: np.ndarray | None = None):
    """Gradients ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``; the interface of
    :func:`qkv.kernels.reference.backward`. ``tiles`` and ``num_threads`` as in
    :func:`~qkv.kernels.flash.forward`. ``precise`` (bool ``(*L, Tq)``), ``norm`` (their
    sums over every key) and ``resid`` (float64 ``(*L, Tq)``: the peaked rows' ``c_i`` over
    every key, :func:`delta_residual` summed; 0 elsewhere) are for a caller whose rows see
    keys beyond ``k`` (the ring, which also says ``blocks=True``: no tile then holds a whole
    row); by default all three come from this call's keys."""
    call, workers, heads_of = _setup(q, k, spec, scale, group, tiles, num_threads, whole_rows=not blocks)
    dt, d = call.dt, q.shape[-1]
    if precise is None:
        precise = own_precise_rows(q, k, lse, spec, scale, group)
    dk = np.zeros(k.shape[:-2] + (k.shape[-2], d), dt)
    dv = np.zeros(k.shape[:-2] + (k.shape[-2], v.shape[-1]), dt)
    with workers as pool:
        kvs, qheads, lanes = _operands(pool, call, heads_of, q, k, v, precise, dout, out, lse, dlse)
        offsets = None
        if precise.any():
            if norm is None:
                norm = _normalisers(pool, call, lanes, kvs, qheads, q.shape[:-1])
            offsets = precise_offsets(lse, precise, norm)
            if resid is None and not blocks and call.mods is None:
                resid = _resid_pass(pool, call, lanes, kvs, qheads, offsets, peaked_rows(precise, norm), dlse)
        if resid is not None:
            for h, qh in qheads.items():
                qh.resid = resid[h]
        dqs = [np.zeros(q.shape, dt) for _ in lanes]
        pool.run([partial(_grad_lane, call, lane, kvs, qheads, offsets, dqs[i], dk, dv)
                  for i, lane in enumerate(lanes)])
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= dt.type(scale)                                          # dQ = scale · dS K
    return dq, dk, dv


def _operands(pool, call, heads_of, q, k, v, precise, dout, out, lse, dlse):
    """``(kvs, qheads, lanes)``: each head's operands, prepared on the pool, and the tasks."""
    any_precise = bool(precise.any())
    kvs = dict(zip([ikv for ikv, _ in heads_of],
                   pool.run([partial(prep_kv, call, ikv, k, v, any_precise) for ikv, _ in heads_of])))
    all_heads = [h for _, hs in heads_of for h in hs]
    qheads = dict(zip(all_heads, pool.run([partial(prep_q, call, h, q, precise, dout, out, lse, dlse)
                                           for h in all_heads])))
    return kvs, qheads, deal(call.spec, heads_of, k.shape[-2], pool.n, call.tiles)


# --- delta from the tiles' own P and dP (the module docstring's last section) --------------------
def peaked_rows(precise: np.ndarray, norm: RowNorm) -> np.ndarray:
    """The precise rows where one key holds all but ``PEAKED`` of the weight (``P_max = 1/l``)."""
    return precise & (norm.l >= 1) & (norm.l < 1 + PEAKED)


def delta_residual(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int,
                   precise: np.ndarray, norm: RowNorm, rows: np.ndarray, *,
                   tiles: Tiles | None = None, num_threads: int | None = None) -> np.ndarray:
    """``c_i = Σ_j P_ij d_ij`` over the keys ``k`` of this call (a block of every row's keys),
    float64 ``(*L, Tq)``, for the bool ``rows`` (0 elsewhere); ``precise`` and ``norm`` as
    :func:`backward` takes them. Add up every block's and pass the sum as ``resid=``."""
    call, workers, heads_of = _setup(q, k, spec, scale, group, tiles, num_threads, whole_rows=False)
    with workers as pool:
        kvs, qheads, lanes = _operands(pool, call, heads_of, q, k, v, precise, dout, out, lse, None)
        resid = _resid_pass(pool, call, lanes, kvs, qheads, precise_offsets(lse, precise, norm), rows)
    return np.zeros(rows.shape) if resid is None else resid


def _resid_pass(pool, call, lanes, kvs, qheads, offsets, rows, dlse=None) -> np.ndarray | None:
    """Per-lane sums of :func:`_resid_lane`, added in a fixed order, less ``dlse`` (the tiles'
    ``d`` carry it: ``Σ_j dS_ij`` is to be ``dlse_i``); ``None`` without ``rows``."""
    if call.mods is not None or not rows.any():
        return None
    parts = [np.zeros(rows.shape) for _ in lanes]
    pool.run([partial(_resid_lane, call, lane, kvs, qheads, offsets, rows, parts[i]) for i, lane in enumerate(lanes)])
    total = parts[0]
    for other in parts[1:]:
        total += other
    return np.where(rows, total if dlse is None else total - dlse, 0.0)


def _resid_lane(call: Call, tasks: list, kvs: dict, qheads: dict, offsets, rows, total) -> None:
    """``Σ_j P_ij d_ij`` over this lane's tiles of the ``rows`` (tiles holding a whole row
    correct themselves): the very tiles the main pass makes, so ``d_ir`` has the same bits."""
    with np.errstate(over="ignore", under="ignore"):
        for task in tasks:
            for h, q0, q1, a, e, partial_, precise, whole in _walk(call, task, qheads):
                if precise and not whole and rows[h][q0:q1].any():
                    _, ds, _ = _grad_tile(call, kvs[task.ikv], qheads[h], offsets, h, q0, q1, a, e, partial_,
                                          precise, whole)
                    total[h][q0:q1] += ds.sum(axis=0, dtype=np.float64)   # (w,r) -> (r,): Σ_j P_ij d_ij


def _normalisers(pool, call, lanes, kvs, qheads, shape) -> RowNorm:
    """The precise rows' sums over this call's keys (a seam the tests count through)."""
    return _sums_pass(pool, call, lanes, kvs, qheads, shape)
