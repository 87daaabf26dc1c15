"""The row kernel's structure without the fast extra: the same stacked products, work units
and causal blocks as :mod:`qkv.kernels.rows.kernel`, with the fewest NumPy passes over the scores.

Where :mod:`..stacked` takes seven element-wise passes over a head's scores (scale, mask, max,
subtract, exp, sum, divide) and the backward nine, this kernel takes, per block of rows:

- forward: ``exp``, and the mask on the block's hidden columns alone (a causal block's
  diagonal square); the row sums are a product with a column of ones. The scale goes into
  q before the product (a ``T × D`` pass, not ``T × T``); no max pass while a row's
  ``Σ exp`` lies in ``[2^-60, 2^64]`` (then no term overflows and none that matters
  underflows, as in the compiled pass); the division goes onto the output rows, once a
  unit (``out = (E V) / Σ``). A block with a row outside that range (scaled scores beyond
  ~±40, a row that sees no key, a NaN) is computed again with its rows' max subtracted
  first, as the reference does.
- backward: ``exp(S - lse)`` with the forward's lse and its row sum ``c`` (lse is rounded
  to float32: at scores of a few hundred its last bit moves every P of the row by 2^-17, so
  the rows are normalised again, by ``1/c`` on the ``T × D`` operands and results; a row
  whose ``c`` leaves ``[2^-60, 2^64]``, an lse an ulp off at scores past ~1e9, takes its own
  max instead: :func:`_weights`), then
  ``dS = P ∘ (dP − Δ)``, with ``Δ_i = dO_i · O_i`` (a ``T × D`` product, not a ``T × T``
  pass), the scale on the ``T × D`` results, the row sums a product with a column of ones.
  (Tried: the subtractions carried by the products as one column more, ``[scale·q, -lse]
  [k, 1]ᵀ = S - lse``: no faster, the odd widths cost BLAS what the passes cost.)

Every pass is a NumPy call with a fixed cost, so units are bigger than the compiled kernel's
and the backward's blocks taller (:data:`UNIT_ENTRIES`, :data:`BACKWARD_ROWS`); temporaries
live in the thread's :mod:`..workspace`.

Float32, plain scores (no softcap or dropout: those go to the stacked, dense or tiled
kernels) and the masks :mod:`.kernel` takes. ``method="auto"`` chooses it without the fast extra
(:func:`qkv.api.choose_kernel`). Every head is computed alone, so the thread count never changes a
bit; the bits are not :mod:`..reference`'s (another order of operations), and the kernel is
tested against it within float32's error budget.
"""
from __future__ import annotations

import functools

import numpy as np

from ...masks import MaskSpec
from .. import workspace
from . import kernel as rows
from .kernel import _flat, _Heads, _inner, _keys_t, _like, _run

# Score entries of one work unit: twice the compiled kernel's (rows.UNIT_ENTRIES). Here a
# unit's every pass is a NumPy call with a fixed cost, and with two threads each call that
# releases the GIL may hand it over; fewer, bigger calls beat the cache they spill. Measured
# (2 threads, AVX-512, forward, ms; 2^14 / 2^16 / 2^17 / 2^18 / 2^19 / 2^20): (32, 8, 128, 64)
# 12.9 / 6.70 / 5.85 / 5.57 / 5.67 / 6.28; fwd+bwd alternating with torch: (1, 8, 256, 16)
# 2.72 at 2^16 against 1.47 at 2^18, (16, 12, 192, 64) 50.7 against 29.2, (8, 12, 1024, 64) 333
# against 330 (one head a unit either way).
UNIT_ENTRIES = 1 << 18
# Query rows a block of the backward where a mask lets blocks skip keys (the forward's are
# rows.row_blocks' own): the backward takes twice the forward's passes a block. Measured
# (causal backward, 2 threads, AVX-512, ms; blocks of 64 / 128 / one block): (1, 8, 256, 16)
# 1.05 / 0.87 / 0.82, (4, 16, 512, 128) 52.8 / 48.6 / 62.0, (8, 12, 1024, 64) 154 / 144 / 231.
BACKWARD_ROWS = 128
# A forward whose blocks average fewer score entries than this (all heads together: the size
# of one of its NumPy passes) runs on the calling thread: with many small passes the second
# Python thread's wake-ups and GIL hand-offs cost more than its core gives. Measured (forward,
# 1 thread ÷ 2 threads time, alternating, AVX-512 Zen 5; entries a block): causal (12,4,64,32)
# 73,728: 0.58, (2,8,128,32) 40,960: 0.78, (4,8,128,32) 81,920: 0.78, (1,8,256,16) 81,920:
# 0.84, (1,4,256,64) 40,960: 0.92, (4,4,64,32) full 65,536: 0.98; against (1,8,512,16) causal
# 147,456: 1.10, (32,4,64,32) causal 196,608: 1.13, (2,8,128,32) full 262,144: 1.05. The
# backward takes twice the passes a block and gained from two threads at every shape tried.
FORWARD_SERIAL_WORK = 1 << 17
TINY, HUGE = np.float32(2.0 ** -60), np.float32(2.0 ** 64)  # a row's Σ exp without its max, to stay exact
# (and E V, undivided, far from float32's overflow)


def applies(spec: MaskSpec, dtype) -> bool:
    """True when this kernel can run the problem (see the module docstring)."""
    return rows.stackable(spec, dtype) and spec.plain_scores


def hidden(spec: MaskSpec, size: int | None = None) -> tuple:
    """One entry a block of :func:`rows.row_blocks` (``size`` as there): ``(c0, c1, h)`` where some row may not
    see some of the block's keys ``c0 <= j < c1`` (relative to the block's first key), ``h``
    ``(R, c1 - c0)`` True where the row may not see the key; None where its rows see all its
    keys. (A causal block's hidden keys are its last R columns, its diagonal square: the
    mask pass covers those alone.)"""
    return _hidden(spec.tq, spec.tk, size, *spec.band, spec.chunk, spec.shift(None), spec.k_start)


@functools.lru_cache(maxsize=64)
def _hidden(tq: int, tk: int, size, *rules):
    out = []
    for r0, r1, k0, k1, lo, hi in rows._row_blocks(tq, tk, size, *rules):
        cols = np.arange(k1 - k0)
        h = (cols < lo[:, None]) | (cols >= hi[:, None])
        where = np.flatnonzero(h.any(axis=0))
        if where.size == 0:
            out.append(None)
            continue
        c0, c1 = int(where[0]), int(where[-1]) + 1
        h = np.ascontiguousarray(h[:, c0:c1])
        h.flags.writeable = False
        out.append((c0, c1, h))
    return tuple(out)


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            num_threads: int | None = None):
    """As :func:`reference.forward` (no weights): ``(out (*L,Tq,Dv), lse (*L,Tq), None)``."""
    inner = _inner(spec, q, k, v)
    qh, kh, vh = _Heads(q, inner), _Heads(k, inner, group), _Heads(v, inner, group)
    n, tq, tk = qh.shape[0], spec.tq, spec.tk
    out = np.empty((n, tq, v.shape[-1]), np.float32)
    lse = np.empty((n, tq), np.float32)
    blocks, masks = rows.row_blocks(spec), hidden(spec)
    sc = np.float32(scale)
    if n * sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1, _, _ in blocks) < FORWARD_SERIAL_WORK * len(blocks):
        num_threads = 1

    def job(a, b):
        qq = _scaled(qh.take(a, b), sc)                       # scaled once: T·D, not T·T
        kt, vv = _keys_t(kh.take(a, b), tk), vh.take(a, b)
        o = _like(out[a:b], qq)
        total = workspace.take("total", qq.shape[:-1] + (1,))  # each row's Σ exp, (…,Tq,1)
        shift = None
        with np.errstate(over="ignore", invalid="ignore"):     # a row past 2^64 is done again below
            for blk, hid in zip(blocks, masks):
                _block(qq, kt, vv, blk, hid, o, total)
            ok = (total >= TINY) & (total <= HUGE)
            if not ok.all():                                  # rare: large scores, a row that sees nothing
                shift = np.zeros(total.shape, np.float32)
                for blk, hid in zip(blocks, masks):
                    if not ok[..., blk[0]:blk[1], :].all():
                        _block(qq, kt, vv, blk, hid, o, total, shift, ok[..., blk[0]:blk[1], :].copy())
        with np.errstate(divide="ignore"):
            np.divide(o, np.where(total > 0, total, 1), out=o)  # a row that sees nothing stays 0 (where= is 5x slower)
            ls = np.log(total[..., 0])
        if shift is not None:
            ls += shift[..., 0]
        lse[a:b] = ls.reshape(b - a, tq)

    _run(job, n, tq, tk, group, num_threads, blocks, inner, max(q.shape[-1], v.shape[-1]), UNIT_ENTRIES)
    return out.reshape(spec.lead + out.shape[-2:]), lse.reshape(spec.lead + (tq,)), None


def _block(qq, kt, vv, blk, hid, o, total, shift=None, kept=None):
    """For the rows ``r0:r1`` of block ``blk``: ``o = exp(S - m) V`` (``S = q kᵀ`` over the
    block's keys, -inf where ``hid``), not yet divided, and ``total = Σ_j exp(S_ij - m_i)``.
    ``m`` is 0, or with ``shift`` the rows' max (0 for a row that sees nothing; stored in
    ``shift``), as the reference subtracts it, except on the rows ``kept`` (…,R,1) True, whose
    first pass stood: they keep ``m = 0`` and so their bits (a row's result must not depend on
    another row of its block, whose keys it may not see)."""
    r0, r1, k0, k1, _, _ = blk
    e = workspace.matmul(qq[..., r0:r1, :], kt[..., k0:k1], "s")   # scaled scores (…,R,K)
    if hid is not None:
        c0, c1, h = hid
        np.copyto(e[..., c0:c1], -np.inf, where=h)
    if shift is not None:
        m = e.max(axis=-1, initial=-np.inf, keepdims=True)
        m[m == -np.inf] = 0
        if kept is not None:
            m[kept] = 0
        e -= m
        shift[..., r0:r1, :] = m
    np.exp(e, out=e)
    np.matmul(e, vv[..., k0:k1, :], out=o[..., r0:r1, :])  # E V, divided by the caller
    np.matmul(e, _ones(e.shape[-1]), out=total[..., r0:r1, :])  # the row sums: see _ones


def _scores(qb, kt, hid, name: str):
    """Scaled scores ``qb kt`` (…,R,K) in the thread's buffer ``name``, -inf where ``hid``."""
    s = workspace.matmul(qb, kt, name)
    if hid is not None:
        c0, c1, h = hid
        np.copyto(s[..., c0:c1], -np.inf, where=h)
    return s


def _weights(qb, kt, hid, lse):
    """``(E, c)``: ``E = exp(S - lse)`` (…,R,K) from the forward's ``lse`` (…,R,1) and its row
    sums ``c`` (…,R,1), 1 up to lse's float32 rounding. A row whose ``c`` leaves ``[2^-60, 2^64]``
    takes its own max instead of lse (the forward's softmax; ``1/c`` normalises either): at
    scores past ~1e9 an lse one ulp (256 at 4e9) off the scores this block's product gives (the
    forward's blocks are other shapes, or another kernel made the lse) made ``exp(S - lse)``
    overflow (NaN gradients) or vanish (gradients 0)."""
    e = _scores(qb, kt, hid, "s")
    e -= lse
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    c = np.matmul(e, _ones(e.shape[-1]))
    ok = (c >= TINY) & (c <= HUGE)
    if not ok.all():                                   # rare: see above; a row that sees nothing stays 0
        s = _scores(qb, kt, hid, "s2")
        m = s.max(axis=-1, initial=-np.inf, keepdims=True)
        m[m == -np.inf] = 0
        s -= m
        np.exp(s, out=s)
        np.copyto(e, s, where=~ok)
        c = np.matmul(e, _ones(e.shape[-1]))
    return e, c


def _scaled(x: np.ndarray, sc: np.float32) -> np.ndarray:
    """``x · sc`` in the thread's buffer ``q``."""
    return np.multiply(x, sc, out=workspace.take("q", x.shape))


@functools.lru_cache(maxsize=16)
def _ones(k: int) -> np.ndarray:
    """A ``(k, 1)`` column of ones: a product with it sums rows in BLAS's matrix-vector pass,
    a quarter of NumPy's pairwise sum's time at 256 keys (12 against 47 µs, 4 heads)."""
    x = np.ones((k, 1), np.float32)
    x.flags.writeable = False
    return x


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None,
             num_threads: int | None = None):
    """As :func:`reference.backward`: ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``, with
    ``P = exp(S - lse)`` from the forward's lse and ``Δ = rowsum(dO ∘ O)`` from its out."""
    inner = _inner(spec, q, k, v, dout, out)
    qh, doh, oh = _Heads(q, inner), _Heads(dout, inner), _Heads(out, inner)
    kh, vh = _Heads(k, inner, group), _Heads(v, inner, group)
    n, tq, tk = qh.shape[0], spec.tq, spec.tk
    ls = lse.reshape(n, tq)
    ls = np.where(ls == -np.inf, np.float32(0), ls)          # a row that sees nothing: exp(-inf - 0) = 0
    dl = None if dlse is None else dlse.reshape(n, tq)
    dq = np.empty(qh.shape, np.float32)
    dk, dv = np.empty(kh.shape, np.float32), np.empty(vh.shape, np.float32)
    blocks, masks = rows.row_blocks(spec, BACKWARD_ROWS), hidden(spec, BACKWARD_ROWS)
    whole = len(blocks) == 1 and blocks[0][2:4] == (0, tk)
    sc = np.float32(scale)

    def job(a, b):
        dd, kk, vv = doh.take(a, b), kh.take(a, b), vh.take(a, b)
        delta = np.vecdot(dd, oh.take(a, b))                  # (…,Tq): Σ_j P_ij dP_ij = dO_i · O_i
        if dl is not None:                                    # ∂lse_i/∂s_ij = P_ij
            delta -= dl[a:b].reshape(delta.shape)
        qq, la = _scaled(qh.take(a, b), sc), ls[a:b].reshape(delta.shape)
        ktt, vtt = _keys_t(kk, tk), _keys_t(vv, tk, "vt")
        gk = gv = None
        if not whole:
            gk, gv = workspace.zeros("gk", (b - a,) + dk.shape[1:]), workspace.zeros("gv", (b - a,) + dv.shape[1:])
        for (r0, r1, k0, k1, _, _), hid in zip(blocks, masks):
            qb, dob = qq[..., r0:r1, :], dd[..., r0:r1, :]
            p, c = _weights(qb, ktt[..., k0:k1], hid, la[..., r0:r1, None])   # P · c_i, c_i
            inv = np.divide(1, c, out=np.zeros_like(c), where=c > 0)
            ds = workspace.matmul(dob, vtt[..., k0:k1], "ds")  # dP = dO Vᵀ
            ds -= delta[..., r0:r1, None]
            ds *= p                                           # dS · c_i / scale
            g = _like(dq[a:b, r0:r1], ds)
            np.matmul(ds, kk[..., k0:k1, :], out=g)
            g *= inv * sc
            qi = np.multiply(qb, inv, out=workspace.take("qi", qb.shape))
            di = np.multiply(dob, inv, out=workspace.take("di", dob.shape))
            pk = _flat(workspace.matmul(np.swapaxes(ds, -1, -2), qi, "pk"))   # q carries the scale: dK = scale dSᵀ Q
            pv = _flat(workspace.matmul(np.swapaxes(p, -1, -2), di, "pv"))
            if whole:
                gk, gv = pk, pv
            else:
                gk[:, k0:k1] += pk
                gv[:, k0:k1] += pv
        if group > 1:
            gk = gk.reshape((-1, group) + gk.shape[-2:]).sum(axis=1)
            gv = gv.reshape((-1, group) + gv.shape[-2:]).sum(axis=1)
        dk[a // group:b // group], dv[a // group:b // group] = gk, gv

    _run(job, n, tq, tk, group, num_threads, blocks, inner, max(q.shape[-1], v.shape[-1]), UNIT_ENTRIES)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
