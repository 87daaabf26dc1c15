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
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ...masks import MaskSpec
from .tiles import DEFAULT, LN2, LOG2E, Tiles, Workers, by_batch, batch_of, chunks, kv_heads, mask_and_bias, scratch

# Base-2 exponent headroom C, and the "bound too loose" threshold: l < 2^-LOOSE.
_HEADROOM = {np.dtype(np.float32): 86.0, np.dtype(np.float64): 430.0}
_LOOSE = {np.dtype(np.float32): 58.0, np.dtype(np.float64): 290.0}


def _alibi_bound(spec: MaskSpec, heads: list, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """Per stacked head, an upper bound of ``-slope·|i' - j|`` over the block (0 if slope >= 0)."""
    if spec.alibi is None:
        return np.zeros(len(heads))
    s = spec.shift(batch_of(spec, heads[0]))
    far = max(abs(q0 + s - (k1 - 1)), abs(q1 - 1 + s - k0), 0)
    slopes = np.array([spec.slopes(h) for h in heads], dtype=np.float64)
    return np.where(slopes < 0, -slopes * far, 0.0)


def _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt, tiles):
    """Online softmax over the runs. Returns ``(out (R, Dv), lse (R,))``."""
    nrow, dv = qs.shape[0], vv.shape[-1]
    m = np.full(nrow, -np.inf, dt)
    l = np.zeros(nrow, dt)
    acc = np.zeros((nrow, dv), dt)
    width = max(16, tiles.scratch // nrow)
    thin = nrow <= tiles.thin_rows
    for a, b, partial in chunks(runs, width):
        if thin:  # decoding: R matrix-vector products per L2-sized key chunk beat one thin GEMM
            s3 = scratch(nrow * (b - a), dt, tiles).reshape(nrow, b - a, 1)
            for c in range(a, b, tiles.gemv_keys):
                e = min(c + tiles.gemv_keys, b)
                np.matmul(kk[c:e], qs[:, :, None], out=s3[:, c - a:e - a])  # (w,D) @ (R,D,1) -> (R,w,1)
            st = s3[:, :, 0].T
        else:
            st = scratch(nrow * (b - a), dt, tiles).reshape(b - a, nrow)  # the tile, transposed
            np.matmul(kk[a:b], qs.T, out=st)                 # (w,D) @ (D,R) -> (w,R)
        mask_and_bias(st, spec, heads, q0, q1, a, b, partial)
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


def _fwd_bound(qs, kk, v1, knorm, spec, heads, q0, q1, runs, dt, tiles):
    """Fixed offset from the Cauchy–Schwarz bound; ``None`` if some row needs the exact path."""
    nrow, dv = qs.shape[0], v1.shape[-1] - 1
    kmax = max(float(knorm[a:b].max()) for a, b, _ in runs)
    qnorm = np.sqrt(np.einsum("rd,rd->r", qs, qs))
    bound = qnorm * dt.type(kmax)                                   # U_i >= every s_ij
    bound = bound.reshape(len(heads), -1) + LOG2E * _alibi_bound(spec, heads, q0, q1, runs[0][0], runs[-1][1])[:, None]
    m = np.maximum(bound.reshape(-1) - _HEADROOM[dt], 0).astype(dt)  # m = max(0, U - C)
    shift = bool(m.any())
    acc = np.zeros((nrow, dv + 1), dt)                              # [acc | l]
    width = max(16, tiles.scratch // nrow)
    for a, b, partial in chunks(runs, width):
        st = scratch(nrow * (b - a), dt, tiles).reshape(b - a, nrow)  # the tile, transposed
        np.matmul(kk[a:b], qs.T, out=st)           # (w,D) @ (D,R) -> (w,R)
        if shift:
            st -= m
        if partial or spec.alibi is not None:
            mask_and_bias(st, spec, heads, q0, q1, a, b, partial)
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
            *, tiles: Tiles | None = None, num_threads: int | None = None):
    """Tiled exact attention; the kernel interface of :func:`qkv.kernels.reference.forward`.

    ``tiles`` (default :class:`Tiles`) and ``num_threads`` (default
    :func:`qkv.get_num_threads`) hold for this call only.
    Returns ``(out (*L,Tq,Dv), lse (*L,Tq), None)``; weights are never made here.
    """
    if return_weights:
        raise ShapeError("the tiled kernel does not make weights; use method='reference' for them")
    tiles = DEFAULT if tiles is None else tiles
    dt = q.dtype
    tq, tk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    lead, lead_kv = spec.lead, k.shape[:-2]
    out = np.zeros(lead + (tq, dv), dt)
    lse = np.full(lead + (tq,), -np.inf, dt)
    dt = np.dtype(dt)
    stack = tq < tiles.stack_rows
    rows = tq if stack else tiles.rows
    sc = dt.type(scale * LOG2E)
    bound_ok = spec.bias is None  # a bias array has no cheap bound: exact path

    def prep(ikv):
        kk = np.ascontiguousarray(k[ikv])  # (Tk, D)
        vv = np.ascontiguousarray(v[ikv])  # (Tk, Dv)
        if not bound_ok or (group * tq if stack else tq) < tiles.stack_rows:
            return kk, vv, None, None
        with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything
            kn = np.sqrt(np.einsum("td,td->t", kk, kk))  # ‖k_j‖, only ever read inside kv_lengths
        v1 = np.empty((tk, dv + 1), dt)
        v1[:, :dv] = vv
        v1[:, dv] = 1
        return kk, vv, v1, kn

    def task(ikv, heads, q0, q1, kv):
        kk, vv, v1, kn = kv
        b = batch_of(spec, heads[0])
        q1 = min(q1, spec.rows(b))  # rows past q_lengths[b] are padding: never read, out 0
        runs = spec.segments(q0, q1, 0, tk, batch=b)
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
                res = _fwd_bound(qs, kk, v1, kn, spec, heads, q0, q1, runs, dt, tiles)
        if res is None:
            res = _fwd_exact(qs, kk, vv, spec, heads, q0, q1, runs, dt, tiles)
        o, ls = res
        n = q1 - q0
        for g, h in enumerate(heads):
            out[h][q0:q1] = o[g * n:(g + 1) * n]
            lse[h][q0:q1] = ls[g * n:(g + 1) * n]

    heads_of = list(kv_heads(lead_kv, group))
    with Workers(num_threads, int(np.prod(lead)) * tq * tk, tiles) as pool:
        _forward_tiles(pool, spec, heads_of, prep, task, stack, rows, tq)
    return out, lse, None


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
