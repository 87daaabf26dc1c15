"""The tiled backward: gradients from the saved ``out`` and ``lse``, P recomputed tile by tile.

**Backward.** With ``P = exp(S - lse)`` (recomputed tile by tile, never stored) and
``dO = ∂L/∂O``::

    dV = Pᵀ dO
    dP = dO Vᵀ
    dS = P ∘ (dP - delta),   delta_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i)
    dQ = scale · dS K,       dK = scale · dSᵀ Q

(the softmax Jacobian ``diag(p) - p pᵀ`` applied row by row gives ``dS``; ``delta`` is a
row of ``O`` against a row of ``dO``, so it needs no tile). Both subtractions ride in the
products as extra columns: ``S - lse = [scale·Q | -hi | -lo] [K | 1 | 1]ᵀ`` (in base 2, with
``log2(e)·lse = hi + lo`` split exactly into two floats, so no rounding of the large
``log2(e)·lse`` enters) and ``dP - delta = [dO | -delta] [V | 1]ᵀ``, so a tile is five
products, one ``exp`` and one multiply. Every allowed ``s_ij <= lse_i``, so ``P <= 1``
never overflows; a row that saw nothing (``lse = -inf``) gets a zero row of
``[dO | -delta]`` and so zero gradients.

**Large scores: the precise path, normalised by itself.** A saved float32 ``lse`` is only
within half an ulp of the true one: at ``|lse| = 1e4`` that is ``5e-4``, and every ``P`` of
the row would be off by that factor (the row sums of ``P`` would not be 1). And a recomputed
score differs from the forward's by about eps times the size of its terms: where one key
dominates a row, its ``P`` should be exactly 1. So rows that the forward's test calls large
(:func:`~.forward_kernel.large_rows`, on the same ``lse``) or whose terms may be large
(``scale·‖q_i‖·max‖k_j‖ > TERMS``) get ``x = (Q Kᵀ)·scale - lse`` in float64 and natural
units, and are normalised by their own sums: a first pass over exactly the same tiles (the
same products, so the same bits) finds ``c_i = log Σ_j exp(x_ij)`` (by a running maximum, so
nothing overflows), and the second uses ``P = exp(x - c)`` (``x - c <= 0`` rounded to the
compute dtype before the exponential). Rows of ``P`` then sum to 1 to rounding whatever
``lse`` was saved, and a row with one dominant key gets ``P = 1`` for it exactly. Only the
score tile of those rows costs float64; the other four products stay in the compute dtype.
"""
from __future__ import annotations

import numpy as np

from ...masks import MaskSpec
from .forward_kernel import large_rows
from . import exp2 as pow2
from .tiles import (DEFAULT, LOG2E, Tiles, Workers, batch_of, bias_limit, by_batch, chunks, kv_heads,
                    mask_and_bias, scratch)

F64 = np.dtype(np.float64)
# Rows whose score terms may reach this size (Cauchy–Schwarz: scale·‖q_i‖·max‖k_j‖) take the
# precise path too: a float score carries an error of about eps times its terms, and a row
# with one dominant key would show it in full (its P should be exactly 1).
TERMS = {np.dtype(np.float32): 32.0, np.dtype(np.float64): 32.0}


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1,
             *, tiles: Tiles | None = None, num_threads: int | None = None):
    """Gradients ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``; the interface of
    :func:`qkv.kernels.reference.backward`. ``tiles`` and ``num_threads`` as in
    :func:`~qkv.kernels.flash.forward`."""
    tiles = DEFAULT if tiles is None else tiles
    dt = np.dtype(q.dtype)
    tq, d = q.shape[-2:]
    tk, dv = k.shape[-2], v.shape[-1]
    lead, lead_kv = spec.lead, k.shape[:-2]
    with np.errstate(over="ignore"):
        sc = dt.type(scale * LOG2E)
    clip = bias_limit(spec, dt)
    masked = spec.bias is not None or spec.alibi is not None
    dk = np.zeros(lead_kv + (tk, d), dt)
    dvv = np.zeros(lead_kv + (tk, dv), dt)
    heads_of = list(kv_heads(lead_kv, group))

    def kmax_of(h) -> float:
        """max ‖k_j‖ over the keys that head h may read (inside its kv_lengths)."""
        kn = knorm[h[:-1] + (h[-1] // group,)] if h else knorm[()]
        n = tk if spec.kv_lengths is None else int(spec.kv_lengths[batch_of(spec, h)])
        return float(kn[:n].max(initial=0.0))

    def prep_q(h):
        ls = lse[h]
        finite = (ls != -np.inf) & (np.arange(tq) < spec.rows(batch_of(spec, h)))  # padding rows: P = 0
        qx = np.empty((tq, d + 2), dt)                            # [log2(e)·scale·Q | -hi | -lo]
        with np.errstate(over="ignore"):
            np.multiply(q[h], sc, out=qx[:, :d])
        with np.errstate(over="ignore"):
            terms = abs(scale) * np.sqrt(np.einsum("td,td->t", q[h], q[h], dtype=np.float64)) * kmax_of(h)
        big = large_rows(ls, tk, dt) | ((terms > TERMS[dt]) | np.isinf(qx[:, :d]).any(axis=1)) & finite
        t = np.where(finite & ~big, ls, 0).astype(np.float64) * LOG2E  # log2(e)·lse = hi + lo exactly
        qx[:, d] = -t                                             # -hi: t rounded to the dtype
        qx[:, d + 1] = -(t + qx[:, d].astype(np.float64))         # -lo = -(t - hi), exact in float64
        qr = np.ascontiguousarray(q[h])                           # Q for dK = scale · dSᵀ Q
        delta = np.einsum("td,td->t", dout[h], out[h])            # delta_i = rowsum(dO_i ∘ O_i)
        dox = np.empty((tq, dv + 1), dt)                          # [dO | -delta], the delta rides in dP
        dox[:, :dv] = np.where(finite[:, None], dout[h], 0)       # rows that saw nothing: zero
        dox[:, dv] = np.where(finite, -delta, 0)
        q64 = None
        if big.any():                                             # Q and lse in float64, natural units
            q64 = (q[h].astype(np.float64), np.where(finite, ls, 0).astype(np.float64))
        return qx, dox, qr, big, q64

    def prep_kv(ikv):
        kx = np.empty((tk, d + 2), dt)                            # [K | 1 | 1]
        kx[:, :d] = k[ikv]
        kx[:, d:] = 1
        v1 = np.empty((tk, dv + 1), dt)                           # [V | 1]
        v1[:, :dv] = v[ikv]
        v1[:, dv] = 1
        return kx, v1

    def walk(hs, c0, c1, qprep):
        """Every tile of a (kv head, key block) task: ``(h, q0, q1, a, e, partial, precise)``."""
        for h in hs:
            big = qprep[h][3]
            b = batch_of(spec, h)
            r0, r1 = spec.query_range(c0, c1, batch=b)
            for q0 in range(r0, r1, tiles.bwd_rows):
                q1 = min(q0 + tiles.bwd_rows, r1)
                precise = bool(big[q0:q1].any())
                for a, e, partial in chunks(spec.segments(q0, q1, c0, c1, batch=b), c1 - c0):
                    yield h, q0, q1, a, e, partial, precise

    def exact_tile(k64, q64, h, q0, q1, a, e, partial):
        """``(S - lse)ᵀ`` of a tile in float64 and natural units, masked (the same bits each call)."""
        x = scratch((q1 - q0) * (e - a), F64, tiles, 2).reshape(e - a, q1 - q0)
        np.matmul(k64[a:e], q64[0][q0:q1].T, out=x)               # (w,D) @ (D,r) -> (w,r): (Q Kᵀ)ᵀ
        x *= scale                                                # scaled after the sum, as the dense path does
        x -= q64[1][q0:q1]
        if partial or masked:
            mask_and_bias(x, spec, [h], q0, q1, a, e, partial, 1.0)
        return x

    def sums(ikv, hs, c0, c1, kv, qprep, acc):
        """First pass of the precise rows: running max ``m`` and ``Σ exp(x - m)`` per row."""
        k64 = kv[2]
        for h, q0, q1, a, e, partial, precise in walk(hs, c0, c1, qprep):
            if not precise:
                continue
            x = exact_tile(k64, qprep[h][4], h, q0, q1, a, e, partial)
            m, l = acc.setdefault(h, (np.full(tq, -np.inf), np.zeros(tq)))
            m_new = np.maximum(m[q0:q1], x.max(axis=0))
            safe = np.where(m_new == -np.inf, 0, m_new)
            x -= safe
            p = scratch(x.size, dt, tiles, 0).reshape(x.shape)
            np.copyto(p, x)                                          # x - m <= 0, rounded to dt
            np.exp(p, out=p)
            l[q0:q1] = l[q0:q1] * np.exp(m[q0:q1] - safe) + p.sum(axis=0, dtype=np.float64)
            m[q0:q1] = m_new

    def task(ikv, hs, c0, c1, kv, qprep, norm, dq):
        """dK, dV of keys c0:c1 of one kv head from all its query heads; dQ into ``dq``."""
        kx, v1 = kv[0], kv[1]
        kk = kx[:, :d]
        dk_loc = np.zeros((c1 - c0, d), dt)
        dv_loc = np.zeros((c1 - c0, dv), dt)
        for h, q0, q1, a, e, partial, precise in walk(hs, c0, c1, qprep):
            qx, dox, qr = qprep[h][:3]
            qb, dob = qx[q0:q1], dox[q0:q1]
            w = e - a
            # tiles are kept transposed, (keys, rows): Pᵀ, dSᵀ
            et = scratch((q1 - q0) * w, dt, tiles, 0).reshape(w, q1 - q0)
            if precise:
                x = exact_tile(kv[2], qprep[h][4], h, q0, q1, a, e, partial)
                x -= norm[h][q0:q1]                                  # S - lse - c, then rounded to dt
                np.copyto(et, x)
                np.exp(et, out=et)                                   # P = exp(S - lse - c)
            else:
                np.matmul(kx[a:e], qb.T, out=et)                     # (w,D+2) @ (D+2,r) -> (w,r): (S - lse)ᵀ
                if partial or masked:
                    mask_and_bias(et, spec, [h], q0, q1, a, e, partial, LOG2E, clip)
                pow2.exp2(et)                                        # P = exp(S - lse)
            dst = scratch((q1 - q0) * w, dt, tiles, 1).reshape(w, q1 - q0)
            np.matmul(v1[a:e], dob.T, out=dst)                       # (w,Dv+1) @ (Dv+1,r): dP - delta
            dst *= et                                                # dS = P ∘ (dP - delta)
            dv_loc[a - c0:e - c0] += et @ dob[:, :dv]                # (w,r) @ (r,Dv): dV += Pᵀ dO
            dk_loc[a - c0:e - c0] += dst @ qr[q0:q1]                 # (w,r) @ (r,D): dK += dSᵀ Q
            dq[h][q0:q1] += dst.T @ kk[a:e]                          # (r,w) @ (w,D): dQ += dS K
        dk_loc *= dt.type(scale)                                     # dK = scale · dSᵀ Q
        dk[ikv][c0:c1] = dk_loc
        dvv[ikv][c0:c1] = dv_loc

    with Workers(num_threads, int(np.prod(lead)) * tq * tk, tiles) as pool:
        all_heads = [h for _, hs in heads_of for h in hs]
        kvprep = pool.run([lambda ikv=ikv: prep_kv(ikv) for ikv, _ in heads_of])
        with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything; never read
            knorm = {ikv: np.sqrt(np.einsum("td,td->t", k[ikv], k[ikv], dtype=np.float64)) for ikv, _ in heads_of}
        qprep = dict(zip(all_heads, pool.run([lambda h=h: prep_q(h) for h in all_heads])))
        lanes = _deal(spec, heads_of, kvprep, tk, pool.n, tiles)
        norm = {}
        if any(p[4] is not None for p in qprep.values()):
            k64 = {ikv: k[ikv].astype(np.float64) for ikv, _ in heads_of}
            lanes = [[args[:4] + ((args[4][0], args[4][1], k64[args[0]]),) for args in lane] for lane in lanes]
            norm = _normalisers(pool, lanes, sums, qprep)
        dqs = [np.zeros(lead + (tq, d), dt) for _ in lanes]

        def lane(i):
            with np.errstate(over="ignore", under="ignore"):
                for args in lanes[i]:
                    task(*args, qprep, norm, dqs[i])

        pool.run([lambda i=i: lane(i) for i in range(len(lanes))])
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= dt.type(scale)                                            # dQ = scale · dS K
    return dq, dk, dvv


def _normalisers(pool, lanes, sums, qprep) -> dict:
    """``c_i = log Σ_j exp(x_ij)`` for every precise row (0 for the others), from per-lane
    running maxima and sums merged in a fixed order."""
    accs = [{} for _ in lanes]

    def lane(i):
        with np.errstate(under="ignore"):
            for args in lanes[i]:
                sums(*args, qprep, accs[i])

    pool.run([lambda i=i: lane(i) for i in range(len(lanes))])
    norm = {}
    for h, (qx, dox, qr, big, q64) in qprep.items():
        parts = [acc[h] for acc in accs if h in acc]
        if not parts:
            continue
        m = np.max([p[0] for p in parts], axis=0)
        safe = np.where(m == -np.inf, 0, m)
        with np.errstate(under="ignore", divide="ignore"):
            l = sum(p[1] * np.exp(p[0] - safe) for p in parts)
            c = safe + np.log(np.where(l > 0, l, 1))
        norm[h] = np.where(big, c, 0.0)
    return norm


def _deal(spec, heads_of, kvprep, tk, n_threads, tiles) -> list:
    """(kv head, key block) tasks, dealt to lanes by a fixed rule (largest first, to the
    least-loaded lane), so a given thread count always adds in the same order."""
    width = tiles.bwd_keys
    while width > 256 and len(heads_of) * -(-tk // width) < 2 * n_threads:
        width //= 2  # two tasks a thread or more, so causal work can be balanced
    tasks = []
    for (ikv, hs), kv in zip(heads_of, kvprep):
        for c0 in range(0, tk, width):
            c1 = min(c0 + width, tk)
            spans = [spec.query_range(c0, c1, batch=batch_of(spec, run[0])) for run in by_batch(spec, hs)]
            rows_seen = sum(max(0, r1 - r0) for r0, r1 in spans)
            if rows_seen:
                tasks.append((rows_seen * (c1 - c0), ikv, hs, c0, c1, kv))
    n = max(1, min(n_threads, len(tasks)))
    lanes = [[] for _ in range(n)]
    load = [0] * n
    for cost, *args in sorted(tasks, key=lambda t: -t[0]):
        i = load.index(min(load))
        lanes[i].append(tuple(args))
        load[i] += cost
    return lanes
