"""The tiled backward: gradients from the saved ``out`` and ``lse``, P recomputed tile by tile.

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
"""
from __future__ import annotations

import numpy as np

from ...masks import MaskSpec
from .tiles import DEFAULT, LN2, LOG2E, Tiles, Workers, batch_of, by_batch, chunks, kv_heads, mask_and_bias, scratch


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
    sc = dt.type(scale * LOG2E)
    dk = np.zeros(lead_kv + (tk, d), dt)
    dvv = np.zeros(lead_kv + (tk, dv), dt)
    heads_of = list(kv_heads(lead_kv, group))

    def prep_q(h):
        ls = lse[h]
        finite = (ls != -np.inf) & (np.arange(tq) < spec.rows(batch_of(spec, h)))  # padding rows: P = 0
        qx = np.empty((tq, d + 1), dt)                            # [log2(e)·scale·Q | -log2(e)·lse]
        np.multiply(q[h], sc, out=qx[:, :d])
        qx[:, d] = np.where(finite, -ls, 0) * dt.type(LOG2E)      # the lse rides in the score product
        delta = np.einsum("td,td->t", dout[h], out[h])            # delta_i = rowsum(dO_i ∘ O_i)
        dox = np.empty((tq, dv + 1), dt)                          # [dO | -delta], the delta rides in dP
        dox[:, :dv] = np.where(finite[:, None], dout[h], 0)       # rows that saw nothing: zero
        dox[:, dv] = np.where(finite, -delta, 0)
        return qx, dox

    def prep_kv(ikv):
        kx = np.empty((tk, d + 1), dt)                            # [K | 1]
        kx[:, :d] = k[ikv]
        kx[:, d] = 1
        v1 = np.empty((tk, dv + 1), dt)                           # [V | 1]
        v1[:, :dv] = v[ikv]
        v1[:, dv] = 1
        return kx, v1

    def task(ikv, hs, c0, c1, kv, qprep, dq):
        """dK, dV of keys c0:c1 of one kv head from all its query heads; dQ into ``dq``."""
        kx, v1 = kv
        kk = kx[:, :d]
        dk_loc = np.zeros((c1 - c0, d), dt)
        dv_loc = np.zeros((c1 - c0, dv), dt)
        for h in hs:
            qx, dox = qprep[h]
            b = batch_of(spec, h)
            r0, r1 = spec.query_range(c0, c1, batch=b)
            for q0 in range(r0, r1, tiles.bwd_rows):
                q1 = min(q0 + tiles.bwd_rows, r1)
                qb, dob = qx[q0:q1], dox[q0:q1]
                runs = spec.segments(q0, q1, c0, c1, batch=b)
                for a, e, partial in chunks(runs, c1 - c0):
                    w = e - a
                    # tiles are kept transposed, (keys, rows): Eᵀ, dSᵀ
                    et = scratch((q1 - q0) * w, dt, tiles, 0).reshape(w, q1 - q0)
                    np.matmul(kx[a:e], qb.T, out=et)                 # (w,D+1) @ (D+1,r) -> (w,r): (S - lse)ᵀ
                    if partial or spec.bias is not None or spec.alibi is not None:
                        mask_and_bias(et, spec, [h], q0, q1, a, e, partial)
                    np.exp2(et, out=et)                              # P = exp(S - lse)
                    dst = scratch((q1 - q0) * w, dt, tiles, 1).reshape(w, q1 - q0)
                    np.matmul(v1[a:e], dob.T, out=dst)               # (w,Dv+1) @ (Dv+1,r): dP - delta
                    dst *= et                                        # dS = P ∘ (dP - delta)
                    dv_loc[a - c0:e - c0] += et @ dob[:, :dv]        # (w,r) @ (r,Dv): dV += Pᵀ dO
                    dk_loc[a - c0:e - c0] += dst @ qb[:, :d]         # (w,r) @ (r,D): dK += scale dSᵀ Q
                    dq[h][q0:q1] += dst.T @ kk[a:e]                  # (r,w) @ (w,D): dQ += dS K
        dk_loc *= dt.type(LN2)                                       # qs carried log2(e)
        dk[ikv][c0:c1] = dk_loc
        dvv[ikv][c0:c1] = dv_loc

    with Workers(num_threads, int(np.prod(lead)) * tq * tk, tiles) as pool:
        all_heads = [h for _, hs in heads_of for h in hs]
        qprep = dict(zip(all_heads, pool.run([lambda h=h: prep_q(h) for h in all_heads])))
        kvprep = pool.run([lambda ikv=ikv: prep_kv(ikv) for ikv, _ in heads_of])
        lanes = _deal(spec, heads_of, kvprep, tk, pool.n, tiles)
        dqs = [np.zeros(lead + (tq, d), dt) for _ in lanes]

        def lane(i):
            with np.errstate(over="ignore", under="ignore"):
                for args in lanes[i]:
                    task(*args, qprep, dqs[i])

        pool.run([lambda i=i: lane(i) for i in range(len(lanes))])
    dq = dqs[0]
    for extra in dqs[1:]:
        dq += extra
    dq *= dt.type(scale)                                            # dQ = scale · dS K
    return dq, dk, dvv


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
        lanes[i].append(args)
        load[i] += cost
    return lanes
