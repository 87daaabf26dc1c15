"""How the tiled kernel cuts its work: tile sizes, threads, scratch buffers and masked tiles.

**Tiles and threads.** The forward splits (head, query block) tasks over threads; the
backward splits (kv head, key block) tasks, so each thread owns its dK and dV, and adds
dQ into a buffer of its own (tasks are dealt to threads by a fixed rule, so a given thread
count always gives the same bits). BLAS is held to one thread while a call runs (see
:mod:`qkv.threads`). Keys that causal, window or kv_lengths remove are never read
(``MaskSpec.segments``); only the narrow partial runs get a mask, and where a causal or
window diagonal crosses a forward task's keys, it is cut into row blocks that each compute
only the keys they see (:func:`diagonal_pieces`).

Tile sizes are a :class:`Tiles` passed to each call (``None``: the defaults below), never a
process-wide setting.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from ... import threads
from ...errors import positive_int
from ...masks import MaskSpec

# Scores are kept in base 2 (q is scaled by scale·log2(e)) because np.exp2 is both faster
# and more accurate than np.exp in float32: exp(s - m) = exp2(log2(e)·s - log2(e)·m).
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one kernel call. The defaults were measured on these machines (Zen 4,
    1 MiB L2 a core): a 512 x 1024 score tile runs OpenBLAS's products at 95 GFLOP/s a core
    against 89 for 256 x 1024 (K = 64), and costs less than it saves in L2 misses."""

    rows: int = 512              # query rows per forward task (fewer when that leaves threads idle)
    scratch: int = 512 * 1024    # elements of one score tile (2 MiB in float32)
    bwd_rows: int = 256          # query rows per backward tile
    bwd_keys: int = 1024         # keys per backward task (fewer when that leaves threads idle)
    thin_rows: int = 8           # at most this many rows: scores by matrix-vector products
    gemv_keys: int = 1024        # keys per matrix-vector chunk (512 KiB of K at D = 128)
    serial_work: int = 1 << 18   # score entries below which a call stays on one thread
    stack_rows: int = 32         # below this many rows per head, stack a kv head's query heads
    diagonal_rows: int = 128     # row blocks of a masked diagonal (causal, window) in the forward

    def __post_init__(self):
        for f in fields(self):
            positive_int(f"Tiles.{f.name}", getattr(self, f.name))


DEFAULT = Tiles()


class Workers:
    """The threads of one kernel call: ``n`` of them, BLAS held to one meanwhile.

    A call with fewer than ``tiles.serial_work`` score entries runs on the calling thread:
    handing out tiles would cost more than it saves. BLAS is held whatever the size (it
    costs microseconds), so a call's bits never depend on what other threads run beside it.
    """

    def __init__(self, num_threads: int | None, work: int, tiles: Tiles):
        self.n = 1 if work < tiles.serial_work else (num_threads or threads.get_num_threads())

    def __enter__(self):
        threads.hold_blas()
        return self

    def __exit__(self, *exc):
        threads.release_blas()

    def run(self, jobs: list) -> list:
        """Call each ``job()``; results in order."""
        if self.n <= 1 or len(jobs) <= 1:
            return [job() for job in jobs]
        return list(threads.pool(self.n).map(lambda job: job(), jobs))


_local = threading.local()


def scratch(size: int, dtype, tiles: Tiles, slot: int = 0) -> np.ndarray:
    """A flat per-thread work buffer of at least ``size`` elements (reused, never shared)."""
    key = (slot, np.dtype(dtype).str)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.size < size:
        buf = bufs[key] = np.empty(max(size, tiles.scratch), dtype)
    return buf[:size]


def kv_heads(lead_kv: tuple, group: int):
    """``(kv index, [query head indices])`` for every kv head."""
    for ikv in np.ndindex(*lead_kv):
        if not ikv:
            yield ikv, [()]
        else:
            yield ikv, [ikv[:-1] + (ikv[-1] * group + g,) for g in range(group)]


def batch_of(spec: MaskSpec, index: tuple) -> int:
    """The batch item (kv_lengths entry) of a leading index."""
    return index[0] if spec.lead else 0


def by_batch(spec: MaskSpec, heads: list) -> list:
    """Split query heads into runs that share a batch item, and so kv_lengths: only these
    may be stacked. Heads of one kv head share it unless the head axis is the first
    leading axis (3-D ``(Hq, Tq, D)`` input with gqa), where kv_lengths is per head."""
    runs = []
    for h in heads:
        if runs and batch_of(spec, runs[-1][-1]) == batch_of(spec, h):
            runs[-1].append(h)
        else:
            runs.append([h])
    return runs


def task_rows(rows: int, tq: int, heads: int) -> int:
    """Query rows per forward task: ``rows``, halved (down to 128) while that leaves fewer than 16
    tasks, so a causal problem's uneven tasks can still be balanced over threads. It depends
    on the problem alone, so every thread count adds in the same order (the same bits)."""
    while rows > 128 and heads * -(-tq // rows) < 16:
        rows //= 2
    return rows


def chunks(runs: list, width: int):
    """Cover contiguous runs ``(a, b, full)`` with near-equal chunks at most ``width`` keys
    wide (multiples of 16), each as ``(a, b, partial)``: the sub-ranges needing a mask."""
    if not runs:
        return
    lo, hi = runs[0][0], runs[-1][1]
    pieces = -(-(hi - lo) // width)
    step = -(-(hi - lo) // pieces)
    step = min(width, -(-step // 16) * 16) if step > 16 else step
    masked = [(a, b) for a, b, full in runs if not full]
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        yield a, b, [(max(a, p), min(b, e)) for p, e in masked if p < b and e > a]


def bias_limit(spec: MaskSpec, dt) -> float | None:
    """The bound to clip a tile's scaled bias to in the compute dtype ``dt``, or None when no
    finite bias comes near it. Beyond it (HF masks with ``finfo.min``, say) the bias times
    log2(e) would overflow; clipped, such entries still weigh exactly 0 beside any other,
    and a row that sees only them is redone on the precise path."""
    limit = float(np.finfo(dt).max) / 8
    if spec.bias is None:
        return None
    finite = spec.bias[np.isfinite(spec.bias)]
    return limit if finite.size and float(np.abs(finite).max()) * LOG2E > limit else None


def mask_and_bias(st: np.ndarray, spec: MaskSpec, heads: list, q0: int, q1: int,
                  a: int, b: int, partial: list, unit: float = LOG2E, clip: float | None = None) -> None:
    """Add bias/ALiBi (times ``unit``: log2(e) for base-2 scores) to a transposed score tile
    ``st (keys, G*rows)`` (keys a:b against rows q0:q1 of each stacked head), clipped to
    ``±clip`` if given (``-inf`` stays), and set masked entries of the ``partial`` key
    sub-ranges to -inf."""
    if st.flags.c_contiguous:
        st3 = st.reshape(b - a, len(heads), q1 - q0)
    else:  # the transposed view of a (G*rows, keys) tile: still a view, never a copy
        st3 = st.T.reshape(len(heads), q1 - q0, b - a).transpose(2, 0, 1)
    if spec.bias is not None or spec.alibi is not None:
        for g, h in enumerate(heads):
            add = spec.additive(q0, q1, a, b, index=h, dtype=st.dtype)
            if not add.flags.owndata or not add.flags.writeable:
                add = add.copy()
            if clip is not None:  # before scaling, so nothing overflows; -inf (cannot attend) stays
                np.minimum(add, clip / unit, out=add)
                np.maximum(add, -clip / unit, out=add, where=add > -np.inf)
            if unit != 1.0:
                np.multiply(add, unit, out=add)
            st3[:, g, :] += add.T
    for p, e in partial:
        sub = st3[p - a:e - a]
        if spec.mask is None:  # structure only: the same for every head
            ok = spec.allowed(q0, q1, p, e, index=heads[0])
            if ok is not None:
                np.copyto(sub, -np.inf, where=~ok.T[:, None, :])
        else:
            for g, h in enumerate(heads):
                np.copyto(sub[:, g, :], -np.inf, where=~spec.allowed(q0, q1, p, e, index=h).T)


class Rows(NamedTuple):
    """Rows ``r0:r1`` of a task (all of them, or a row block of a masked diagonal) and the key
    sub-ranges of the tile that need a mask."""

    r0: int
    r1: int
    partial: list


def structural(spec: MaskSpec) -> bool:
    """True when a tile's mask is the band alone (causal, window): no user mask, chunk,
    bias or ALiBi. Key and query lengths only cut the tile's extent (``segments``)."""
    return spec.mask is None and spec.chunk is None and spec.bias is None and spec.alibi is None


def diagonal_pieces(spec, head, q0, q1, a, b, partial, step):
    """Keys a:b of a task's rows q0:q1, where ``partial`` key runs need a mask (a causal or
    window diagonal), as tiles ``(k0, k1, Rows)``: the unmasked keys against all rows, then
    each masked run against row blocks of ``step``, each only over the keys it may see
    (``MaskSpec.segments``). A causal diagonal of four row blocks so costs 5/8 of its square."""
    cuts = sorted({a, b} | {x for run in partial for x in run})
    masked = set(partial)
    batch = head[0] if spec.lead else 0
    for k0, k1 in zip(cuts, cuts[1:]):
        if (k0, k1) not in masked:
            yield k0, k1, Rows(q0, q1, [])
            continue
        for r0 in range(q0, q1, step):
            r1 = min(r0 + step, q1)
            segs = spec.segments(r0, r1, k0, k1, batch=batch)
            if segs:
                yield segs[0][0], segs[-1][1], Rows(r0, r1, [(x, y) for x, y, full in segs if not full])


def alibi_bound(spec: MaskSpec, heads: list, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """Per stacked head, an upper bound of ``-slope·|i' - j|`` over the block (0 if slope >= 0)."""
    if spec.alibi is None:
        return np.zeros(len(heads))
    s = spec.shift(batch_of(spec, heads[0]))
    far = max(abs(q0 + s - (k1 - 1)), abs(q1 - 1 + s - k0), 0)
    slopes = np.array([spec.slopes(h) for h in heads], dtype=np.float64)
    return np.where(slopes < 0, -slopes * far, 0.0)


# --- the backward's tasks --------------------------------------------------------------------
@dataclass
class Task:
    """The keys ``c0:c1`` of one kv head, against all its query heads."""

    ikv: tuple
    heads: list
    c0: int
    c1: int


def deal(spec, heads_of, tk, n_threads, tiles) -> list:
    """(kv head, key block) tasks, dealt to lanes by a fixed rule (largest first, to the
    least-loaded lane), so a given thread count always adds in the same order."""
    width = tiles.bwd_keys
    while n_threads > 1 and width > 256 and len(heads_of) * -(-tk // width) < 2 * n_threads:
        width //= 2  # two tasks a thread or more, so causal work can be balanced (one thread:
        # whole rows in a task, whose P are normalised by their own sums; see _grad_tile)
    tasks = []
    for ikv, hs in heads_of:
        for c0 in range(0, tk, width):
            c1 = min(c0 + width, tk)
            spans = [spec.query_range(c0, c1, batch=batch_of(spec, run[0])) for run in by_batch(spec, hs)]
            rows_seen = sum(max(0, r1 - r0) for r0, r1 in spans)
            if rows_seen:
                tasks.append((rows_seen * (c1 - c0), Task(ikv, hs, c0, c1)))
    n = max(1, min(n_threads, len(tasks)))
    lanes = [[] for _ in range(n)]
    load = [0] * n
    for cost, task in sorted(tasks, key=lambda t: -t[0]):
        i = load.index(min(load))
        lanes[i].append(task)
        load[i] += cost
    return lanes
