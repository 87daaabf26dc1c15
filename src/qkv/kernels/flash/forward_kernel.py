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
``s_j <= U_i = scale · ‖q_i‖ · max_j ‖k_j‖`` (plus an upper bound of the ALiBi term). With
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
``log Tk`` on the high side; ordinary attention stays inside), the task is redone by the
online softmax with the scores ``(Q Kᵀ)·scale`` and the offsets in float64 and natural
units (:func:`_fwd_precise`); each ``s - m <= 0`` is rounded to the compute dtype only
before its exponential. For float32 input the scores are then exact far below what float32
shows; for float64 input it is the dense path's arithmetic, without base-2 roundings. A bias
such as ``finfo(float32).min`` (Hugging Face's mask value) neither overflows there nor hides
the row's other terms; on the fast path it is clipped (:func:`~.tiles.bias_limit`), which
changes nothing unless a row sees only such keys, and such a row is large. A row that sees
nothing is one the *mask* empties (``-inf`` or a structural mask), never one whose finite
scores are merely large. The exact path stops as soon as a row maximum shows the task is
large, and the bound path is not tried where only large rows could pass it. The backward
applies the same test to the saved ``lse`` to choose its precise, self-normalised path.
"""
from __future__ import annotations

import math

import numpy as np

from ... import jit
from ...errors import ShapeError
from ...masks import MaskSpec
from . import exp2 as pow2
from .tiles import (DEFAULT, LOG2E, Tiles, Workers, batch_of, bias_limit, by_batch, chunks, kv_heads,
                    mask_and_bias, scratch)

# Base-2 exponent headroom C, and the "bound too loose" threshold: l < 2^-LOOSE.
_HEADROOM = {np.dtype(np.float32): 86.0, np.dtype(np.float64): 430.0}
_LOOSE = {np.dtype(np.float32): 58.0, np.dtype(np.float64): 290.0}
# A row maximum beyond ±LARGE (read from lse) takes the precise path; see large_rows.
LARGE = {np.dtype(np.float32): 16.0, np.dtype(np.float64): 16.0}


def large_rows(lse: np.ndarray, tk: int, dt) -> np.ndarray:
    """Rows whose ``lse`` says their largest score is beyond ``±LARGE`` (``lse <= max + log Tk``).
    NaN and ``-inf`` (a NaN input, a row that sees nothing) are not large."""
    big = LARGE[np.dtype(dt)]
    return (lse > big + math.log(tk)) | ((lse < -big) & (lse > -np.inf))  # NaN compares False, quietly


def _alibi_bound(spec: MaskSpec, heads: list, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """Per stacked head, an upper bound of ``-slope·|i' - j|`` over the block (0 if slope >= 0)."""
    if spec.alibi is None:
        return np.zeros(len(heads))
    s = spec.shift(batch_of(spec, heads[0]))
    far = max(abs(q0 + s - (k1 - 1)), abs(q1 - 1 + s - k0), 0)
    slopes = np.array([spec.slopes(h) for h in heads], dtype=np.float64)
    return np.where(slopes < 0, -slopes * far, 0.0)


def _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt, tiles, clip=None, stop=np.inf):
    """Online softmax over the runs, in base 2. Returns ``(out (R, Dv), m (R,), l (R,))``
    (``lse = (m + log2 l) · ln 2``), or None as soon as a row's maximum passes ``stop``."""
    nrow, dv = qs.shape[0], vv.shape[-1]
    m = np.full(nrow, -np.inf, dt)
    l = np.zeros(nrow)                                       # float64: a float32 running sum over Tk keys erred ~√Tk ulps
    acc = np.zeros((nrow, dv), dt)
    width = max(16, tiles.scratch // nrow)
    thin = nrow <= tiles.thin_rows
    compiled = thin and dt == np.float32 and jit.compiled()  # decoding: K and V read once each, compiled
    for a, b, partial in chunks(runs, width):
        if compiled:
            s2 = scratch(nrow * (b - a), dt, tiles).reshape(nrow, b - a)
            compiled.thin_scores(kk[a:b], qs, s2)
            st = s2.T
        elif thin:  # decoding: R matrix-vector products per L2-sized key chunk beat one thin GEMM
            s3 = scratch(nrow * (b - a), dt, tiles).reshape(nrow, b - a, 1)
            for c in range(a, b, tiles.gemv_keys):
                e = min(c + tiles.gemv_keys, b)
                np.matmul(kk[c:e], qs[:, :, None], out=s3[:, c - a:e - a])  # (w,D) @ (R,D,1) -> (R,w,1)
            st = s3[:, :, 0].T
        else:
            st = scratch(nrow * (b - a), dt, tiles).reshape(b - a, nrow)  # the tile, transposed
            np.matmul(kk[a:b], qs.T, out=st)                 # (w,D) @ (D,R) -> (w,R)
        mask_and_bias(st, spec, heads, q0, q1, a, b, partial, LOG2E, clip)
        m_new = np.maximum(m, st.max(axis=0))                # m' = max(m, max_j s_j)
        if (m_new > stop).any():
            return None                                      # a large row: the precise path will redo it
        m_safe = np.where(m_new == -np.inf, 0, m_new).astype(dt, copy=False)
        alpha = np.exp2(m - m_safe)                          # exp(m - m'); 0 while m = -inf
        l *= alpha
        pow2.sub_exp2(st, m_safe, l)                         # exp(s_j - m'); l' = alpha l + Σ exp(s_j - m')
        acc *= alpha[:, None]
        if compiled:
            compiled.thin_values(st.T, vv[a:b], acc)
        elif thin:  # by L2-sized chunks of V too: OpenBLAS takes (R,1024) @ (1024,Dv) at twice the rate
            for c in range(a, b, tiles.gemv_keys):
                e = min(c + tiles.gemv_keys, b)
                acc += st[c - a:e - a].T @ vv[c:e]
        else:
            acc += st.T @ vv[a:b]                            # (R,w) @ (w,Dv) -> (R,Dv)
        m = m_new
    seen = l != 0  # l = 0: the row saw nothing; l = NaN (a NaN input) stays NaN, as in the reference
    return (acc / np.where(seen, l, 1)[:, None]).astype(dt, copy=False), m, l


def _fwd_precise(qs, kk, vv, scale, spec, heads, q0, q1, runs, dt, tiles):
    """The online softmax with the scores and offsets in float64 and natural units: ``qs``
    (unscaled) and ``kk`` are float64, ``vv`` in the compute dtype ``dt``. ``exp(s - m)`` (at most 1)
    is rounded to ``dt`` before the exponential, so the terms and sums cost what the exact
    path's do. Returns ``(out (R, Dv), m (R,) float64, l (R,))``."""
    nrow, dv = qs.shape[0], vv.shape[-1]
    m = np.full(nrow, -np.inf)
    l = np.zeros(nrow)
    acc = np.zeros((nrow, dv), dt)
    width = max(16, tiles.scratch // nrow)
    for a, b, partial in chunks(runs, width):
        s64 = scratch(nrow * (b - a), np.float64, tiles, 1).reshape(b - a, nrow)
        np.matmul(kk[a:b], qs.T, out=s64)                    # (w,D) @ (D,R) -> (w,R), float64
        s64 *= scale                                         # scaled after the sum, as the dense path does
        mask_and_bias(s64, spec, heads, q0, q1, a, b, partial, 1.0)
        m_new = np.maximum(m, s64.max(axis=0))               # m' = max(m, max_j s_j)
        m_safe = np.where(m_new == -np.inf, 0, m_new)
        alpha = np.exp(m - m_safe)                           # exp(m - m'); 0 while m = -inf
        s64 -= m_safe
        st = scratch(nrow * (b - a), dt, tiles).reshape(b - a, nrow)
        np.copyto(st, s64)                                   # s_j - m' <= 0, rounded to dt
        np.exp(st, out=st)                                   # exp(s_j - m')
        l *= alpha
        l += st.sum(axis=0, dtype=np.float64)                # l' = alpha l + Σ exp(s_j - m')
        acc *= alpha[:, None].astype(dt)
        acc += st.T @ vv[a:b]                                # (R,w) @ (w,Dv) -> (R,Dv)
        m = m_new
    seen = l != 0
    return acc / np.where(seen, l, 1)[:, None].astype(dt), m, l


def _fwd_bound(qs, kk, vv, knorm, spec, heads, q0, q1, runs, dt, tiles):
    """Fixed offset from the Cauchy–Schwarz bound; ``None`` if some row needs the exact path.
    Returns ``(out (R, Dv), m (R,), l (R,))`` in base 2."""
    nrow, dv = qs.shape[0], vv.shape[-1]
    kmax = max(float(knorm[a:b].max()) for a, b, _ in runs)
    qnorm = np.sqrt(np.einsum("rd,rd->r", qs, qs))
    bound = qnorm * dt.type(kmax)                                   # U_i >= every s_ij
    bound = bound.reshape(len(heads), -1) + LOG2E * _alibi_bound(spec, heads, q0, q1, runs[0][0], runs[-1][1])[:, None]
    m = np.maximum(bound.reshape(-1) - _HEADROOM[dt], 0).astype(dt)  # m = max(0, U - C)
    offset = m if m.any() else None                                 # m = 0: no subtraction
    acc = np.zeros((nrow, dv), dt)
    l = np.zeros(nrow)                                       # float64: a float32 running sum over Tk keys erred ~√Tk ulps
    width = max(16, tiles.scratch // nrow)
    split = len(heads) == 1 and spec.mask is None and nrow > tiles.diagonal_rows
    for a, b, partial in chunks(runs, width):
        if split and partial:  # the masked keys by narrower row blocks: each computes only what it sees
            for c0, c1, rows in _diagonal_pieces(spec, heads[0], q0, q1, a, b, partial, tiles.diagonal_rows):
                _bound_tile(qs, kk, vv, offset, acc, l, spec, heads, q0, q1, c0, c1, rows, dt, tiles)
            continue
        _bound_tile(qs, kk, vv, offset, acc, l, spec, heads, q0, q1, a, b, (q0, q1, partial), dt, tiles)
    if not (l >= 2.0 ** -_LOOSE[dt]).all():
        return None  # a row's largest term is tiny (or it sees nothing): redo exactly
    if not (np.isfinite(acc).all() and np.isfinite(l).all()):
        return None  # terms up to 2^C times large values overflowed: redo with terms <= 1
    return (acc / l[:, None]).astype(dt, copy=False), m, l


def _bound_tile(qs, kk, vv, m, acc, l, spec, heads, q0, q1, a, b, rows, dt, tiles) -> None:
    """One tile of the bound path: keys a:b against rows ``r0:r1`` (of the task's q0:q1),
    ``rows = (r0, r1, partial)``, offsets ``m`` (None: 0); adds ``Σ p v`` into ``acc`` and
    ``Σ p`` into ``l`` (in the exponential's pass: a column of ones beside V, which was how
    the sums came before, slows OpenBLAS's product by 10 % at Dv = 64)."""
    r0, r1, partial = rows
    i0, i1 = (0, qs.shape[0]) if (r0, r1) == (q0, q1) else (r0 - q0, r1 - q0)  # all stacked heads, or a row block
    st = scratch((i1 - i0) * (b - a), dt, tiles).reshape(b - a, i1 - i0)  # the tile, transposed
    np.matmul(kk[a:b], qs[i0:i1].T, out=st)        # (w,D) @ (D,r) -> (w,r)
    mi = None if m is None else m[i0:i1]
    if partial and len(heads) == 1 and _structural(spec) and \
            pow2.band_sub_exp2(st, np.zeros(i1 - i0, dt) if mi is None else mi, a, r0,
                               spec.shift(batch_of(spec, heads[0])), *spec.band, l=l[i0:i1]):
        acc[i0:i1] += st.T @ vv[a:b]               # a diagonal masked inside the exponential's pass
        return
    if partial or spec.alibi is not None:
        mask_and_bias(st, spec, heads, r0, r1, a, b, partial)
    pow2.sub_exp2(st, mi, l[i0:i1])                # exp(s_ij - m_i) <= 2^C, and Σ_j, in one pass
    acc[i0:i1] += st.T @ vv[a:b]                   # (r,w) @ (w,Dv) -> (r,Dv): Σ p v


def _structural(spec: MaskSpec) -> bool:
    """True when a tile's mask is the band alone (causal, window): no user mask, chunk,
    bias or ALiBi. Key and query lengths only cut the tile's extent (``segments``)."""
    return spec.mask is None and spec.chunk is None and spec.bias is None and spec.alibi is None


def _diagonal_pieces(spec, head, q0, q1, a, b, partial, step):
    """Keys a:b of a task's rows q0:q1, where ``partial`` key runs need a mask (a causal or
    window diagonal), as tiles ``(k0, k1, (r0, r1, partial'))``: the unmasked keys against all
    rows, then each masked run against row blocks of ``step``, each only over the keys it may
    see (``MaskSpec.segments``). A causal diagonal of four row blocks so costs 5/8 of its square."""
    cuts = sorted({a, b} | {x for run in partial for x in run})
    masked = set(partial)
    batch = head[0] if spec.lead else 0
    for k0, k1 in zip(cuts, cuts[1:]):
        if (k0, k1) not in masked:
            yield k0, k1, (q0, q1, [])
            continue
        for r0 in range(q0, q1, step):
            r1 = min(r0 + step, q1)
            segs = spec.segments(r0, r1, k0, k1, batch=batch)
            if segs:
                yield segs[0][0], segs[-1][1], (r0, r1, [(x, y) for x, y, full in segs if not full])


def _bound_may_do(qs, knorm, runs, stop2, dt) -> bool:
    """False when the bound path could only succeed for rows beyond ``stop2`` (it succeeds
    when the largest term is at least 2^-LOOSE of 2^(U - C)), which are redone precisely."""
    kmax = max(float(knorm[a:b].max()) for a, b, _ in runs)
    with np.errstate(over="ignore", invalid="ignore"):
        u = float(np.sqrt(np.einsum("rd,rd->r", qs, qs)).max()) * kmax
    return u - _HEADROOM[dt] - _LOOSE[dt] <= stop2


def _lse(m, l, unit) -> np.ndarray:
    """``(m + log l) / unit`` in float64 (log in base e^unit), ``-inf`` where l = 0."""
    m, l = np.asarray(m, np.float64), np.asarray(l, np.float64)
    seen = l != 0
    log = np.log2 if unit != 1.0 else np.log
    return np.where(seen, (np.where(seen, m, 0) + log(np.where(seen, l, 1))) / unit, -np.inf)


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
    tiles = DEFAULT if tiles is None else tiles
    dt = np.dtype(q.dtype)
    tq, tk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lead, lead_kv = spec.lead, k.shape[:-2]
    out = np.zeros(lead + (tq, dv), dt)
    lse = np.full(lead + (tq,), -np.inf, dt if lse_dtype is None else lse_dtype)
    stack = tq < tiles.stack_rows
    rows = tq if stack else _task_rows(tiles.rows, tq, int(np.prod(lead)))
    with np.errstate(over="ignore"):
        sc = dt.type(scale * LOG2E)
    fast = bool(np.isfinite(sc))  # else scores in base 2 overflow the dtype: precise path only
    clip = bias_limit(spec, dt)
    bound_ok = spec.bias is None  # a bias array has no cheap bound: exact path

    stop2 = (LARGE[dt] + np.log(tk)) * LOG2E     # in base 2: a row maximum beyond it is large

    def prep(ikv):
        kk = np.ascontiguousarray(k[ikv])  # (Tk, D)
        vv = np.ascontiguousarray(v[ikv])  # (Tk, Dv)
        if not bound_ok or (group * tq if stack else tq) < tiles.stack_rows:
            return kk, vv, None            # the exact path alone: no key norms (decoding reads K once)
        with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything
            kn = np.sqrt(np.einsum("td,td->t", kk, kk))  # ‖k_j‖, only ever read inside kv_lengths
        return kk, vv, kn

    def fast_task(heads, q0, q1, runs, kv):
        """The compute-dtype attempt: ``(out, lse float64)``, or None to go precise."""
        kk, vv, kn = kv
        n = q1 - q0
        qs = np.empty((len(heads) * n, d), dt)
        with np.errstate(over="ignore"):
            for g, h in enumerate(heads):
                np.multiply(q[h][q0:q1], sc, out=qs[g * n:(g + 1) * n])
        if np.isinf(qs).any():
            return None
        res = None
        if kn is not None and _bound_may_do(qs, kn, runs, stop2, dt):
            # overflow (and inf - inf inside the product, which some BLAS kernels report as
            # invalid) is detected there and the rows redone exactly: no warning escapes
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                res = _fwd_bound(qs, kk, vv, kn, spec, heads, q0, q1, runs, dt, tiles)
        if res is None:
            with np.errstate(over="ignore", under="ignore"):
                res = _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt, tiles, clip, stop2)
            if res is None:
                return None
        o, m, l = res
        ls = _lse(m, l, LOG2E)
        if large_rows(ls, tk, dt).any() or np.isinf(o).any():
            return None
        return o, ls

    def precise_task(heads, q0, q1, runs, kv):
        """Scores in float64 and natural units (see the module docstring)."""
        lo, hi = runs[0][0], runs[-1][1]
        kk = np.zeros((tk, d))
        kk[lo:hi] = kv[0][lo:hi]                 # the visible span only: padding is never read
        n = q1 - q0
        qs = np.empty((len(heads) * n, d), np.float64)
        for g, h in enumerate(heads):
            qs[g * n:(g + 1) * n] = q[h][q0:q1]
        with np.errstate(under="ignore"):
            o, m, l = _fwd_precise(qs, kk, kv[1], scale, spec, heads, q0, q1, runs, dt, tiles)
        return o, _lse(m, l, 1.0)

    def task(ikv, heads, q0, q1, kv):
        b = batch_of(spec, heads[0])
        q1 = min(q1, spec.rows(b))  # rows past q_lengths[b] are padding: never read, out 0
        runs = spec.segments(q0, q1, 0, tk, batch=b)
        if not runs:
            return  # no key visible: out 0, lse -inf as initialised
        res = fast_task(heads, q0, q1, runs, kv) if fast else None
        if res is None:
            res = precise_task(heads, q0, q1, runs, kv)
        o, ls = res
        n = q1 - q0
        for g, h in enumerate(heads):
            out[h][q0:q1] = o[g * n:(g + 1) * n]
            lse[h][q0:q1] = ls[g * n:(g + 1) * n]

    heads_of = list(kv_heads(lead_kv, group))
    with Workers(num_threads, int(np.prod(lead)) * tq * tk, tiles) as pool:
        _forward_tiles(pool, spec, heads_of, prep, task, stack, rows, tq)
    return out, lse, None


def _task_rows(rows: int, tq: int, heads: int) -> int:
    """Query rows per task: ``rows``, halved (down to 128) while that leaves fewer than 16
    tasks, so a causal problem's uneven tasks can still be balanced over threads. It depends
    on the problem alone, so every thread count adds in the same order (the same bits)."""
    while rows > 128 and heads * -(-tq // rows) < 16:
        rows //= 2
    return rows


def _forward_tiles(pool, spec, heads_of, prep, task, stack, rows, tq):
    """Prepare every kv head, then run the (heads, query block) tasks, late rows first."""
    kvs = pool.run([lambda ikv=ikv: prep(ikv) for ikv, _ in heads_of])
    jobs = []
    for (ikv, hs), kv in zip(heads_of, kvs):
        groups = by_batch(spec, hs) if stack else [[h] for h in hs]
        for heads in groups:
            for q0 in range(0, tq, rows):
                jobs.append(lambda ikv=ikv, heads=heads, q0=q0, kv=kv:
                            task(ikv, heads, q0, min(q0 + rows, tq), kv))
    jobs.reverse()  # causal: the late rows see the most keys; start them first
    pool.run(jobs)
