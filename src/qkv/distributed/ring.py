"""Ring attention: exact attention over a sequence split across the ranks of a communicator.

Rank r holds its tokens of q, k and v (see :mod:`qkv.distributed.layout`). The key/value
blocks travel around the ring, each rank sending to r+1 and receiving from r-1, so at
step s rank r holds the keys of rank ``r - s``; after W steps every query has met every
key. Each step runs the tiled kernel on (this rank's queries, the block it holds), one
contiguous (query piece, key piece) pair at a time with the pieces' global positions as
``q_start``/``k_start``, so causal, window, chunk, ALiBi and kv_lengths mean what they
mean on the whole arrays. A pair that the mask removes entirely is not computed.

**Forward.** Partial results over disjoint key sets merge exactly by their log-sum-exp
(:func:`qkv.numerics.merge_partials`, in the compute dtype)::

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

**Backward.** With the final (global) ``out`` and ``lse``, ``P = exp(S - lse)`` of any
block is exact on its own, so each block's gradients are the single-process ones restricted
to it: dQ sums over the blocks a rank meets and stays local; dK and dV of a block sum over
every rank's queries, so they travel with the block and, one hop after the last step,
arrive home (W hops in all). Rows where one key holds nearly all the weight take delta from
the tiles' own P and dP, summed over every block first (one more trip of K and V, only when
some rank has such a row; the derivation is in :mod:`qkv.kernels.flash.backward_kernel`).

**Overlap.** The next block's ``Isend``/``Irecv`` are posted before the current block is
computed; the incoming dK/dV sum is only waited for after the next block's compute. A
step moves ``2·c·D·Hkv`` elements per batch item (K and V, kv heads only, never repeated)
against ``4·c²·D·Hq`` FLOP of forward compute for c local tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import api
from .. import options as opts
from ..errors import OptionError, ShapeError, as_float_array, fmt_shape
from ..extras import require
from ..kernels import flash
from ..masks import MaskSpec, build_spec
from ..numerics import merge_partials
from .agree import agree
from .layout import check_layout, pieces, world

TAG_K, TAG_V, TAG_DK, TAG_DV = 11, 12, 13, 14


@dataclass
class Ring:
    """One checked ring call on this rank."""

    comm: object
    size: int
    rank: int
    layout: str
    prob: api.Problem     # local q (*L, c, D) and the caller's shapes; its spec is unused
    spec: MaskSpec        # the global spec: T = W·c, global kv_lengths and alignment
    k: np.ndarray         # this rank's k in the compute dtype, the caller's shape: what travels
    v: np.ndarray

    @property
    def local(self) -> int:
        return self.prob.q.shape[-2]

    def mine(self) -> list:
        return pieces(self.layout, self.size, self.rank, self.local)

    def pairs(self, src: int):
        """``(local q slice, local k slice, spec)`` of every (query piece, key piece of rank
        ``src``) pair that some query may see."""
        for qg, qo, n in self.mine():
            for kg, ko, m in pieces(self.layout, self.size, src, self.local):
                sp = self.spec
                lengths = None if sp.kv_lengths is None else np.clip(sp.kv_lengths - kg, 0, m)
                sp = replace(sp, tq=n, tk=m, q_start=qg, k_start=kg, kv_lengths=lengths)
                batches = range(sp.lead[0]) if sp.lead else [0]
                if any(sp.segments(0, n, 0, m, batch=b) for b in batches):
                    yield slice(qo, qo + n), slice(ko, ko + m), sp

    def kv_block(self, k, v, ks: slice):
        """A key piece of a travelling block, broadcast to the kernel's ``(*Lk, m, D)``."""
        lead_kv = self.prob.k.shape[:-2]
        kk, vv = k[..., ks, :], v[..., ks, :]
        return (np.broadcast_to(kk, lead_kv + kk.shape[-2:]),
                np.broadcast_to(vv, lead_kv + vv.shape[-2:]))


def _mpi():
    return require("mpi4py.MPI", "mpi")


def _setup(what, q, k, v, comm, layout, options: dict, extra=None) -> Ring:
    """Check every rank's inputs and ``options`` (the problem's, bound) collectively (see
    :mod:`.agree`); ``extra(prob)`` checks more arrays and returns them."""
    comm, size, rank = world(comm)
    mask, bias, scale, gqa = (options[n] for n in ("mask", "bias", "scale", "gqa"))
    structure = {n: options[n] for n in opts.MASK if n in options and n not in ("mask", "bias")}

    def check():
        if mask is not None or bias is not None:
            raise ShapeError(
                "mask and bias are dense (..., Tq, Tk) arrays, which ring attention never holds; "
                "say it with causal=, window=, chunk=, kv_lengths= or alibi=")
        lay = check_layout(layout)
        prob = api.prepare(q, k, v, scale=scale, gqa=gqa)
        c = prob.spec.tq
        if prob.spec.tk != c:
            raise ShapeError(
                f"ring attention is self-attention over one sequence: k must hold this rank's "
                f"Tq = {c} tokens, shape (..., {c}, D); got {fmt_shape(np.shape(k))}")
        if lay == "zigzag" and c % 2:
            raise ShapeError(
                f"layout 'zigzag' holds two equal chunks per rank, so the local length must be "
                f"even; got q {fmt_shape(np.shape(q))} (pad T to a multiple of 2W = {2 * size} "
                f"and pass kv_lengths)")
        spec = build_spec(prob.spec.lead, c * size, c * size, dtype=prob.q.dtype, **structure)
        return prob, spec, (extra(prob) if extra else None)

    shapes = {name: (np.shape(x), str(getattr(x, "dtype", type(x).__name__)))
              for name, x in (("q", q), ("k", k), ("v", v))}
    prob, spec, more = agree(comm, what, check, dict(
        shapes=shapes, layout=layout, scale=scale, gqa=gqa, **structure))
    dt = prob.q.dtype
    kc = np.array(np.asarray(k), dtype=dt, order="C", copy=True)   # receive buffers overwrite it
    vc = np.array(np.asarray(v), dtype=dt, order="C", copy=True)
    ring = Ring(comm, size, rank, layout, prob, spec, kc, vc)
    return ring if extra is None else (ring, more)


def _travel(ring: Ring, bufs: list):
    """Yield ``(src, blocks)`` for each of the W steps, the next step's blocks in flight
    (sent to r+1, received from r-1) while the caller computes on these."""
    MPI = _mpi()
    comm, size, rank = ring.comm, ring.size, ring.rank
    cur = bufs
    nxt = [np.empty_like(b) for b in bufs] if size > 1 else None
    for step in range(size):
        reqs = []
        if step < size - 1:
            for i, (a, b) in enumerate(zip(cur, nxt)):
                reqs.append(comm.Isend(a, dest=(rank + 1) % size, tag=TAG_K + i))
                reqs.append(comm.Irecv(b, source=(rank - 1) % size, tag=TAG_K + i))
        yield (rank - step) % size, cur
        MPI.Request.Waitall(reqs)
        cur, nxt = nxt, cur


# the options the ring takes (qkv.options.LACKS says which of qkv.attention's it does not, and why)
FORWARD = opts.names("mask", "problem", "output", "kernel", lacking="ring_attention")
BACKWARD = opts.names("mask", "problem", "kernel", lacking="ring_attention")


def ring_attention(q, k, v, *, comm=None, layout="zigzag", **options):
    """Self-attention over a sequence split across the ranks of ``comm``; this rank's rows.

    Every rank passes its own tokens (:func:`qkv.distributed.shard`): ``q (..., Hq, c, D)``,
    ``k (..., Hkv, c, D)``, ``v (..., Hkv, c, Dv)`` with ``c = T/W``, the same shapes and
    options on every rank. The options mean exactly what they mean in :func:`qkv.attention`
    on the whole arrays, with global positions: ``kv_lengths`` are global lengths per batch
    item, ``alibi`` is ``-slope·|i - j|`` of global positions, ``gqa`` groups heads as there.
    ``mask``/``bias`` are dense and not offered: a ShapeError.

    Collective: the inputs are checked on all ranks before the first step, so a bad input
    on any rank raises the same ShapeError on every rank. Run scripts as
    ``mpiexec -n W python -m mpi4py script.py`` so that an exception on one rank later on
    ends the whole job instead of leaving the others waiting.

    Returns ``out (..., Hq, c, Dv)`` in q's dtype, and ``lse (..., Hq, c)`` (float32, or
    float64 for float64 input) with ``return_lse=True``.
    """
    bound = opts.bind("ring_attention", options, FORWARD, opts.LACKS["ring_attention"])
    return_lse = bound.pop("return_lse")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise OptionError(f"return_lse must be True or False; got {return_lse!r}")
    ring = _setup("ring_attention", q, k, v, comm, layout, bound)
    prob = ring.prob
    dt = prob.q.dtype
    # out, lse and the merge weights in float64, rounded once at the end: a float32 partial
    # lse is off by half its ulp, and exp(lse_a - lse) carried that into out (2-10x the
    # float32 error at scores of std 20-35)
    out = np.zeros(prob.q.shape[:-1] + (prob.v.shape[-1],))       # (*L, c, Dv)
    lse = np.full(prob.q.shape[:-1], -np.inf)                     # (*L, c)
    for src, (kb, vb) in _travel(ring, [ring.k, ring.v]):
        for qs, ks, sp in ring.pairs(src):
            kk, vv = ring.kv_block(kb, vb, ks)
            o, ls, _ = flash.forward(prob.q[..., qs, :], kk, vv, sp, prob.scale, prob.group, lse_dtype=np.float64)
            out[..., qs, :], lse[..., qs] = merge_partials(out[..., qs, :], lse[..., qs], o, ls)
    out = out.astype(prob.in_dtype, copy=False)
    return (out, lse.astype(dt)) if return_lse else out


ring_attention.__signature__ = opts.signature(("q", "k", "v"), FORWARD, before=(("comm", None), ("layout", "zigzag")))


def ring_attention_backward(dout, q, k, v, out, lse, *, comm=None, layout="zigzag", **options):
    """This rank's ``(dq, dk, dv)`` of :func:`ring_attention`, given its ``dout`` and the
    ``out``, ``lse`` that ``ring_attention(..., return_lse=True)`` returned here.

    Same arguments and the same collective checks as :func:`ring_attention`; each gradient
    has its input's shape and dtype (the sum over every rank's queries for dk and dv).
    """
    bound = opts.bind("ring_attention_backward", options, BACKWARD, opts.LACKS["ring_attention"])

    def extra(prob):
        want = prob.q.shape[:-1] + (prob.v.shape[-1],)
        arrays = []
        for name, x, shape, names in (("dout", dout, want, "(..., Hq, c, Dv)"),
                                      ("out", out, want, "(..., Hq, c, Dv)"),
                                      ("lse", lse, want[:-1], "(..., Hq, c)")):
            x = as_float_array(name, x)
            if x.shape != shape:
                raise ShapeError(f"{name} must have shape {names} = {fmt_shape(shape)}; got {fmt_shape(x.shape)}")
            arrays.append(x.astype(prob.q.dtype, copy=False))
        return arrays

    ring, (do, o, ls) = _setup("ring_attention_backward", q, k, v, comm, layout, bound, extra)
    MPI = _mpi()
    prob, comm = ring.prob, ring.comm
    dt, d = prob.q.dtype, prob.q.shape[-1]
    precise, norm = _precise_sums(ring, ls)
    resid = None if norm is None else _delta_residual(ring, do, o, ls, precise, norm)
    right, left = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    dq = np.zeros(prob.q.shape, dt)                               # (*L, c, D)
    incoming, recv, sending = [], None, []
    for src, (kb, vb) in _travel(ring, [ring.k, ring.v]):
        dk = np.zeros(kb.shape, dt)                               # this block's part, caller's k shape
        dv = np.zeros(vb.shape, dt)
        for qs, ks, sp in ring.pairs(src):
            kk, vv = ring.kv_block(kb, vb, ks)
            dqp, dkp, dvp = flash.backward(do[..., qs, :], prob.q[..., qs, :], kk, vv, o[..., qs, :],
                                           ls[..., qs], sp, prob.scale, prob.group,
                                           precise=precise[..., qs], norm=None if norm is None else norm.rows(qs),
                                           resid=None if resid is None else resid[..., qs], blocks=True)
            dq[..., qs, :] += dqp
            dk[..., ks, :] += api.sum_to(dkp, kb.shape[:-2] + (dkp.shape[-2], d))
            dv[..., ks, :] += api.sum_to(dvp, vb.shape[:-2] + dvp.shape[-2:])
        MPI.Request.Waitall(incoming + sending)   # the sum so far from the ranks before us
        if recv is not None:
            dk += recv[0]
            dv += recv[1]
        recv = [np.empty_like(dk), np.empty_like(dv)]
        sending = [comm.Isend(dk, dest=right, tag=TAG_DK), comm.Isend(dv, dest=right, tag=TAG_DV)]
        incoming = [comm.Irecv(recv[0], source=left, tag=TAG_DK), comm.Irecv(recv[1], source=left, tag=TAG_DV)]
    MPI.Request.Waitall(incoming + sending)       # W hops: our own block's sum is home
    q_shape = prob.shapes[0]
    return (api.sum_to(dq, q_shape).astype(prob.in_dtype, copy=False),
            recv[0].astype(prob.in_dtype, copy=False), recv[1].astype(prob.in_dtype, copy=False))


ring_attention_backward.__signature__ = opts.signature(("dout", "q", "k", "v", "out", "lse"), BACKWARD,
                                                       before=(("comm", None), ("layout", "zigzag")))


def _precise_sums(ring: Ring, lse: np.ndarray):
    """The rows that take the tiled backward's precise path, chosen for the whole sequence,
    and their sums over every key (``None`` when no rank has such a row).

    A precise row is normalised by its own ``m = max_j x_ij`` and ``l = Σ_j exp(x_ij - m)``
    over all its keys (see :mod:`qkv.kernels.flash.backward_kernel`); a block holds only some
    of them, so the keys make one trip around the ring first (K only, and only when some rank
    has a precise row), and each block's backward gets the whole row's sums.
    """
    MPI = _mpi()
    prob, spec = ring.prob, ring.spec
    kmax = np.zeros(spec.lead)                                    # max ‖k_j‖ over every key a head may read
    for kg, ko, m in ring.mine():
        lengths = None if spec.kv_lengths is None else np.clip(spec.kv_lengths - kg, 0, m)
        piece = replace(spec, tk=m, kv_lengths=lengths)
        kmax = np.maximum(kmax, flash.key_norm_max(prob.k[..., ko:ko + m, :], piece, prob.group))
    ring.comm.Allreduce(MPI.IN_PLACE, kmax, op=MPI.MAX)
    precise = flash.precise_rows(prob.q, lse, spec, prob.scale, kmax)
    if not ring.comm.allreduce(bool(precise.any()), op=MPI.LOR):
        return precise, None
    norm = flash.RowNorm.empty(precise.shape)
    for src, (kb,) in _travel(ring, [ring.k.copy()]):
        for qs, ks, sp in ring.pairs(src):
            kk = ring.kv_block(kb, kb, ks)[0]
            part = flash.row_sums(prob.q[..., qs, :], kk, sp, prob.scale, prob.group, precise[..., qs])
            both = norm.rows(qs).merge(part)
            norm.m[..., qs], norm.l[..., qs] = both.m, both.l
    return precise, norm


def _delta_residual(ring: Ring, do, o, lse, precise, norm):
    """The peaked rows' ``c_i = Σ_j P_ij d_ij`` over every key (see
    :mod:`qkv.kernels.flash.backward_kernel`: delta from the tiles' own P and dP), or ``None``
    when no rank has such a row. Like the sums, it needs every key first: K and V make one
    more trip around the ring, only then."""
    MPI = _mpi()
    prob = ring.prob
    rows = flash.peaked_rows(precise, norm)
    if not ring.comm.allreduce(bool(rows.any()), op=MPI.LOR):
        return None
    resid = np.zeros(rows.shape)                                  # (*L, c) float64
    for src, (kb, vb) in _travel(ring, [ring.k.copy(), ring.v.copy()]):
        for qs, ks, sp in ring.pairs(src):
            kk, vv = ring.kv_block(kb, vb, ks)
            resid[..., qs] += flash.delta_residual(do[..., qs, :], prob.q[..., qs, :], kk, vv, o[..., qs, :], lse[..., qs],
                                                   sp, prob.scale, prob.group, precise[..., qs], norm.rows(qs),
                                                   rows[..., qs])
    return resid
