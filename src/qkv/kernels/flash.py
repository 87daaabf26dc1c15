"""Exact attention in tiles: online-softmax forward and a backward that recomputes P from lse.

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
``m`` never changes: no rescaling of ``acc``, no max pass, and the row sum comes out of the
value product for free by giving V a column of ones, ``[acc | l] = Σ_j exp(s_j - m) [v_j | 1]``.
A block then costs two matrix products and one in-place ``exp``. The bound may be loose;
float32 keeps full relative precision for ``exp(x)`` down to ``x ≈ -87``, so the result
is exact to rounding as long as the largest term is not tiny: rows whose ``l < e^-40``
(including rows that see nothing) are redone on the exact path, and so are rows whose
``acc`` overflowed (terms up to ``2^C`` times values near the top of the dtype's range).

**Base 2.** ``exp(s - m) = 2^(log2(e)·s - log2(e)·m)``: q is scaled by ``log2(e)·scale``
once, offsets and ``lse`` are kept in base 2 inside the kernel, and ``np.exp2`` replaces
``np.exp`` (in float32 it is about twice as fast and more accurate).

**Backward.** With ``P = exp(S - lse)`` (recomputed tile by tile, never stored) and
``dO = ∂L/∂O``::

    dV = Pᵀ dO
    dP = dO Vᵀ
    dS = P ∘ (dP - delta),   delta_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i)
    dQ = scale · dS K,       dK = scale · dSᵀ Q

(the softmax Jacobian ``diag(p) - p pᵀ`` applied row by row gives ``dS``; ``delta`` is a
row of ``O`` against a row of ``dO``, so it needs no tile). Both subtractions ride in the
products as one extra column: ``S - lse = [scale·Q | -lse] [K | 1]ᵀ`` and
``dP - delta = [dO | -delta] [V | 1]ᵀ``, so a tile is five products, one ``exp`` and one
multiply. Every allowed ``s_ij <= lse_i``, so ``P <= 1`` never overflows; a row that saw
nothing (``lse = -inf``) gets a zero row of ``[dO | -delta]`` and so zero gradients.

**Tiles and threads.** The forward splits (head, query block) tasks over threads; the
backward splits (kv head, key block) tasks, so each thread owns its dK and dV, and adds
dQ into a buffer of its own (tasks are dealt to threads by a fixed rule, so a given thread
count always gives the same bits). BLAS is held to one thread inside the pool. Keys that
causal, window or kv_lengths remove are never read (``MaskSpec.segments``); only the
narrow partial runs get a mask.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import threads
from ..errors import ShapeError
from ..masks import MaskSpec

# Tile sizes: a score tile of rows x keys should stay well inside a core's L2 (1 MiB here).
ROWS = 256             # query rows per forward task
SCRATCH = 256 * 1024   # elements of one score tile (1 MiB in float32)
BWD_ROWS = 256         # query rows per backward tile
BWD_KEYS = 1024        # keys per backward task (fewer when that leaves threads idle)
THIN_ROWS = 8          # at most this many rows: scores by matrix-vector products
GEMV_KEYS = 1024       # keys per matrix-vector chunk (512 KiB of K at D = 128)
SERIAL_WORK = 1 << 18  # score entries below which a call stays on one thread
STACK_ROWS = 32        # below this many rows per head, stack a kv head's query heads

# Scores are kept in base 2 (q is scaled by scale·log2(e)) because np.exp2 is both faster
# and more accurate than np.exp in float32: exp(s - m) = exp2(log2(e)·s - log2(e)·m).
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
# Base-2 exponent headroom C, and the "bound too loose" threshold: l < 2^-LOOSE.
_HEADROOM = {np.dtype(np.float32): 86.0, np.dtype(np.float64): 430.0}
_LOOSE = {np.dtype(np.float32): 58.0, np.dtype(np.float64): 290.0}

# ----------------------------------------------------------------------------- threads
_local = threading.local()


class _Threads:
    """The threads of one kernel call: ``n`` of them, BLAS held to one meanwhile.

    A call with fewer than ``SERIAL_WORK`` score entries runs on the calling thread: handing
    out tiles would cost more than it saves. BLAS is held whatever the size (it costs
    microseconds), so a call's bits never depend on what other threads run beside it.
    """

    def __init__(self, num_threads, work: int):
        self.n = 1 if work < SERIAL_WORK else (num_threads or threads.get_num_threads())

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


def _scratch(size: int, dtype, slot: int = 0) -> np.ndarray:
    """A flat per-thread work buffer of at least ``size`` elements (reused, never shared)."""
    key = (slot, np.dtype(dtype).str)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.size < size:
        buf = bufs[key] = np.empty(max(size, SCRATCH), dtype)
    return buf[:size]


# ----------------------------------------------------------------------------- helpers
def _heads(lead_kv: tuple, group: int):
    """``(kv index, [query head indices])`` for every kv head."""
    for ikv in np.ndindex(*lead_kv):
        if not ikv:
            yield ikv, [()]
        else:
            yield ikv, [ikv[:-1] + (ikv[-1] * group + g,) for g in range(group)]


def _batch(spec: MaskSpec, index: tuple) -> int:
    return index[0] if spec.lead else 0


def _by_batch(spec: MaskSpec, heads: list) -> list:
    """Split query heads into runs that share a batch item, and so kv_lengths: only these
    may be stacked. Heads of one kv head share it unless the head axis is the first
    leading axis (3-D ``(Hq, Tq, D)`` input with gqa), where kv_lengths is per head."""
    runs = []
    for h in heads:
        if runs and _batch(spec, runs[-1][-1]) == _batch(spec, h):
            runs[-1].append(h)
        else:
            runs.append([h])
    return runs


def _chunks(runs: list, width: int):
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


def _mask_and_bias(st: np.ndarray, spec: MaskSpec, heads: list, q0: int, q1: int,
                   a: int, b: int, partial: list) -> None:
    """Add bias/ALiBi to a transposed score tile ``st (keys, G*rows)`` (keys a:b against
    rows q0:q1 of each stacked head) and set masked entries of the ``partial`` key
    sub-ranges to -inf."""
    if st.flags.c_contiguous:
        st3 = st.reshape(b - a, len(heads), q1 - q0)
    else:  # the transposed view of a (G*rows, keys) tile: still a view, never a copy
        st3 = st.T.reshape(len(heads), q1 - q0, b - a).transpose(2, 0, 1)
    if spec.bias is not None or spec.alibi is not None:
        for g, h in enumerate(heads):
            add = spec.additive(q0, q1, a, b, index=h, dtype=st.dtype)
            st3[:, g, :] += np.multiply(add, LOG2E, out=add if add.flags.owndata else None).T
    for p, e in partial:
        sub = st3[p - a:e - a]
        if spec.mask is None:  # structure only: the same for every head
            ok = spec.allowed(q0, q1, p, e, index=heads[0])
            if ok is not None:
                np.copyto(sub, -np.inf, where=~ok.T[:, None, :])
        else:
            for g, h in enumerate(heads):
                np.copyto(sub[:, g, :], -np.inf, where=~spec.allowed(q0, q1, p, e, index=h).T)


def _alibi_bound(spec: MaskSpec, heads: list, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """Per stacked head, an upper bound of ``-slope·|i' - j|`` over the block (0 if slope >= 0)."""
    if spec.alibi is None:
        return np.zeros(len(heads))
    off = spec.offset
    far = max(abs(q0 + off - (k1 - 1)), abs(q1 - 1 + off - k0), 0)
    slopes = np.array([spec.alibi[h[-1]] for h in heads], dtype=np.float64)
    return np.where(slopes < 0, -slopes * far, 0.0)


# ----------------------------------------------------------------------------- forward
def _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt):
    """Online softmax over the runs. Returns ``(out (R, Dv), lse (R,))``."""
    nrow, dv = qs.shape[0], vv.shape[-1]
    m = np.full(nrow, -np.inf, dt)
    l = np.zeros(nrow, dt)
    acc = np.zeros((nrow, dv), dt)
    width = max(16, SCRATCH // nrow)
    thin = nrow <= THIN_ROWS
    for a, b, partial in _chunks(runs, width):
        if thin:  # decoding: R matrix-vector products per L2-sized key chunk beat one thin GEMM
            s3 = _scratch(nrow * (b - a), dt).reshape(nrow, b - a, 1)
            for c in range(a, b, GEMV_KEYS):
                e = min(c + GEMV_KEYS, b)
                np.matmul(kk[c:e], qs[:, :, None], out=s3[:, c - a:e - a])  # (w,D) @ (R,D,1) -> (R,w,1)
            st = s3[:, :, 0].T
        else:
            st = _scratch(nrow * (b - a), dt).reshape(b - a, nrow)  # the tile, transposed
            np.matmul(kk[a:b], qs.T, out=st)                 # (w,D) @ (D,R) -> (w,R)
        _mask_and_bias(st, spec, heads, q0, q1, a, b, partial)
        m_new = np.maximum(m, st.max(axis=0))                # m' = max(m, max_j s_j)
        m_safe = np.where(m_new == -np.inf, 0, m_new).astype(dt, copy=False)
        alpha = np.exp2(m - m_safe)                          # exp(m - m'); 0 while m = -inf
        st -= m_safe
        np.exp2(st, out=st)                                  # exp(s_j - m')
        l *= alpha
        l += st.sum(axis=0)                                  # l' = alpha l + Σ exp(s_j - m')
        acc *= alpha[:, None]
        acc += st.T @ vv[a:b]                                # (R,w) @ (w,Dv) -> (R,Dv)
        m = m_new
    seen = l != 0  # l = 0: the row saw nothing; l = NaN (a NaN input) stays NaN, as in the reference
    out = acc / np.where(seen, l, 1)[:, None]
    with np.errstate(divide="ignore"):
        lse = np.where(seen, (np.where(seen, m, 0) + np.log2(np.where(seen, l, 1))) * LN2, -np.inf)
    return out, lse.astype(dt, copy=False)


def _fwd_bound(qs, kk, v1, knorm, spec, heads, q0, q1, runs, dt):
    """Fixed offset from the Cauchy–Schwarz bound; ``None`` if some row needs the exact path."""
    nrow, dv = qs.shape[0], v1.shape[-1] - 1
    kmax = max(float(knorm[a:b].max()) for a, b, _ in runs)
    qnorm = np.sqrt(np.einsum("rd,rd->r", qs, qs))
    bound = qnorm * dt.type(kmax)                                   # U_i >= every s_ij
    bound = bound.reshape(len(heads), -1) + LOG2E * _alibi_bound(spec, heads, q0, q1, runs[0][0], runs[-1][1])[:, None]
    m = np.maximum(bound.reshape(-1) - _HEADROOM[dt], 0).astype(dt)  # m = max(0, U - C)
    shift = bool(m.any())
    acc = np.zeros((nrow, dv + 1), dt)                              # [acc | l]
    width = max(16, SCRATCH // nrow)
    for a, b, partial in _chunks(runs, width):
        st = _scratch(nrow * (b - a), dt).reshape(b - a, nrow)  # the tile, transposed
        np.matmul(kk[a:b], qs.T, out=st)           # (w,D) @ (D,R) -> (w,R)
        if shift:
            st -= m
        if partial or spec.alibi is not None:
            _mask_and_bias(st, spec, heads, q0, q1, a, b, partial)
        np.exp2(st, out=st)                        # exp(s_ij - m_i) <= 2^C
        acc += st.T @ v1[a:b]                      # (R,w) @ (w,Dv+1) -> (R,Dv+1): [Σ p v | Σ p]
    l = acc[:, dv]
    if not (l >= 2.0 ** -_LOOSE[dt]).all():
        return None  # a row's largest term is tiny (or it sees nothing): redo exactly
    if not np.isfinite(acc).all():
        return None  # terms up to 2^C times large values overflowed: redo with terms <= 1
    out = acc[:, :dv] / l[:, None]
    return out, (m + np.log2(l)) * dt.type(LN2)   # lse = m + log l


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            num_threads: int | None = None):
    """Tiled exact attention; the kernel interface of :func:`qkv.reference.forward`.

    Returns ``(out (*L,Tq,Dv), lse (*L,Tq), None)``; weights are never made here.
    """
    if return_weights:
        raise ShapeError("the tiled kernel does not make weights; use method='reference' for them")
    dt = q.dtype
    tq, tk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    lead, lead_kv = spec.lead, k.shape[:-2]
    out = np.zeros(lead + (tq, dv), dt)
    lse = np.full(lead + (tq,), -np.inf, dt)
    dt = np.dtype(dt)
    stack = tq < STACK_ROWS
    rows = tq if stack else ROWS
    sc = dt.type(scale * LOG2E)
    bound_ok = spec.bias is None  # a bias array has no cheap bound: exact path

    def prep(ikv):
        kk = np.ascontiguousarray(k[ikv])  # (Tk, D)
        vv = np.ascontiguousarray(v[ikv])  # (Tk, Dv)
        if not bound_ok or (group * tq if stack else tq) < STACK_ROWS:
            return kk, vv, None, None
        with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything
            kn = np.sqrt(np.einsum("td,td->t", kk, kk))  # ‖k_j‖, only ever read inside kv_lengths
        v1 = np.empty((tk, dv + 1), dt)
        v1[:, :dv] = vv
        v1[:, dv] = 1
        return kk, vv, v1, kn

    def task(ikv, heads, q0, q1, kv):
        kk, vv, v1, kn = kv
        runs = spec.segments(q0, q1, 0, tk, batch=_batch(spec, heads[0]))
        if not runs:
            return  # no key visible: out 0, lse -inf as initialised
        qs = np.empty((len(heads) * (q1 - q0), q.shape[-1]), dt)
        for g, h in enumerate(heads):
            np.multiply(q[h][q0:q1], sc, out=qs[g * (q1 - q0):(g + 1) * (q1 - q0)])
        res = None
        if v1 is not None:
            # overflow (and inf - inf inside the product, which some BLAS kernels report as
            # invalid) is detected there and the rows redone exactly: no warning escapes
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                res = _fwd_bound(qs, kk, v1, kn, spec, heads, q0, q1, runs, dt)
        if res is None:
            res = _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt)
        o, ls = res
        n = q1 - q0
        for g, h in enumerate(heads):
            out[h][q0:q1] = o[g * n:(g + 1) * n]
            lse[h][q0:q1] = ls[g * n:(g + 1) * n]

    heads_of = list(_heads(lead_kv, group))
    with _Threads(num_threads, int(np.prod(lead)) * tq * tk) as pool:
        _forward_tiles(pool, spec, heads_of, prep, task, stack, rows, tq)
    return out, lse, None


def _forward_tiles(pool, spec, heads_of, prep, task, stack, rows, tq):
    """Prepare every kv head, then run the (heads, query block) tasks, late rows first."""
    kvs = pool.run([lambda ikv=ikv: prep(ikv) for ikv, _ in heads_of])
    jobs = []
    for (ikv, hs), kv in zip(heads_of, kvs):
        groups = _by_batch(spec, hs) if stack else [[h] for h in hs]
        for heads in groups:
            for q0 in range(0, tq, rows):
                jobs.append(lambda ikv=ikv, heads=heads, q0=q0, kv=kv:
                            task(ikv, heads, q0, min(q0 + rows, tq), kv))
    jobs.reverse()  # causal: the late rows see the most keys; start them first
    pool.run(jobs)


# ----------------------------------------------------------------------------- backward
def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1,
             num_threads: int | None = None):
    """Gradients ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``; the interface of
    :func:`qkv.reference.backward`. P is recomputed from ``lse`` tile by tile."""
    dt = np.dtype(q.dtype)
    tq, d = q.shape[-2:]
    tk, dv = k.shape[-2], v.shape[-1]
    lead, lead_kv = spec.lead, k.shape[:-2]
    sc = dt.type(scale * LOG2E)
    dk = np.zeros(lead_kv + (tk, d), dt)
    dvv = np.zeros(lead_kv + (tk, dv), dt)
    heads_of = list(_heads(lead_kv, group))
    pool = _Threads(num_threads, int(np.prod(lead)) * tq * tk)

    def prep_q(h):
        ls = lse[h]
        finite = ls != -np.inf
        qx = np.empty((tq, d + 1), dt)                            # [log2(e)·scale·Q | -log2(e)·lse]
        np.multiply(q[h], sc, out=qx[:, :d])
        qx[:, d] = np.where(finite, -ls, 0) * dt.type(LOG2E)      # the lse rides in the score product
        r = finite.astype(dt)                                     # rows that saw nothing: P = 0
        delta = np.einsum("td,td->t", dout[h], out[h])            # delta_i = rowsum(dO_i ∘ O_i)
        dox = np.empty((tq, dv + 1), dt)                          # [dO | -delta], the delta rides in dP
        np.multiply(dout[h], r[:, None], out=dox[:, :dv])
        dox[:, dv] = -delta * r
        return qx, dox

    def prep_kv(ikv):
        kx = np.empty((tk, d + 1), dt)                            # [K | 1]
        kx[:, :d] = k[ikv]
        kx[:, d] = 1
        v1 = np.empty((tk, dv + 1), dt)                           # [V | 1]
        v1[:, :dv] = v[ikv]
        v1[:, dv] = 1
        return kx, v1

    with pool:
        all_heads = [h for _, hs in heads_of for h in hs]
        qprep = dict(zip(all_heads, pool.run([lambda h=h: prep_q(h) for h in all_heads])))
        kvprep = pool.run([lambda ikv=ikv: prep_kv(ikv) for ikv, _ in heads_of])

        def task(ikv, hs, c0, c1, kv, dq):
            kx, v1 = kv
            kk = kx[:, :d]
            dk_loc = np.zeros((c1 - c0, d), dt)
            dv_loc = np.zeros((c1 - c0, dv), dt)
            for h in hs:
                qx, dox = qprep[h]
                b = _batch(spec, h)
                r0, r1 = spec.query_range(c0, c1, batch=b)
                for q0 in range(r0, r1, BWD_ROWS):
                    q1 = min(q0 + BWD_ROWS, r1)
                    qb, dob = qx[q0:q1], dox[q0:q1]
                    runs = spec.segments(q0, q1, c0, c1, batch=b)
                    for a, e, partial in _chunks(runs, c1 - c0):
                        w = e - a
                        # tiles are kept transposed, (keys, rows): Eᵀ, dSᵀ
                        et = _scratch((q1 - q0) * w, dt, 0).reshape(w, q1 - q0)
                        np.matmul(kx[a:e], qb.T, out=et)                 # (w,D+1) @ (D+1,r) -> (w,r): (S - lse)ᵀ
                        if partial or spec.bias is not None or spec.alibi is not None:
                            _mask_and_bias(et, spec, [h], q0, q1, a, e, partial)
                        np.exp2(et, out=et)                              # P = exp(S - lse)
                        dst = _scratch((q1 - q0) * w, dt, 1).reshape(w, q1 - q0)
                        np.matmul(v1[a:e], dob.T, out=dst)               # (w,Dv+1) @ (Dv+1,r): dP - delta
                        dst *= et                                        # dS = P ∘ (dP - delta)
                        dv_loc[a - c0:e - c0] += et @ dob[:, :dv]        # (w,r) @ (r,Dv): dV += Pᵀ dO
                        dk_loc[a - c0:e - c0] += dst @ qb[:, :d]         # (w,r) @ (r,D): dK += scale dSᵀ Q
                        dq[h][q0:q1] += dst.T @ kk[a:e]                  # (r,w) @ (w,D): dQ += dS K
            dk_loc *= dt.type(LN2)                                       # qs carried log2(e)
            dk[ikv][c0:c1] = dk_loc
            dvv[ikv][c0:c1] = dv_loc

        # (kv head, key block) tasks, dealt to threads by a fixed rule (largest first, to the
        # least-loaded thread), so a given thread count always adds in the same order.
        width = BWD_KEYS
        while width > 256 and len(heads_of) * -(-tk // width) < 2 * pool.n:
            width //= 2  # two tasks a thread or more, so causal work can be balanced
        tasks = []
        for (ikv, hs), kv in zip(heads_of, kvprep):
            for c0 in range(0, tk, width):
                c1 = min(c0 + width, tk)
                spans = [spec.query_range(c0, c1, batch=_batch(spec, run[0])) for run in _by_batch(spec, hs)]
                rows_seen = sum(max(0, r1 - r0) for r0, r1 in spans)
                if rows_seen:
                    tasks.append((rows_seen * (c1 - c0), ikv, hs, c0, c1, kv))
        n = max(1, min(pool.n, len(tasks)))
        lanes = [[] for _ in range(n)]
        load = [0] * n
        for cost, *args in sorted(tasks, key=lambda t: -t[0]):
            i = load.index(min(load))
            lanes[i].append(args)
            load[i] += cost
        dqs = [np.zeros(lead + (tq, d), dt) for _ in range(n)]

        def lane(i):
            with np.errstate(over="ignore", under="ignore"):
                for args in lanes[i]:
                    task(*args, dqs[i])

        pool.run([lambda i=i: lane(i) for i in range(n)])
        dq = dqs[0]
        for extra in dqs[1:]:
            dq += extra
        dq *= dt.type(scale)                                            # dQ = scale · dS K
        return dq, dk, dvv
