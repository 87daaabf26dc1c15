"""Softcap and dropout (:mod:`qkv.score_ops`) on the tiled kernel's score tiles.

A tile here is transposed, ``(keys, rows)``, and in base 2 (``log2(e)·x``), so the softcap
``c·tanh(x / c)`` becomes ``C·tanh(t / C)`` with ``C = log2(e)·c`` on the tile ``t``, applied
straight after the product and before the bias, ALiBi and masks (a masked ``-inf`` must stay
``-inf``). Dropout multiplies the tile's exponentials by ``keep / (1 - p)`` *after* they were
added into the row sums ``l`` (``lse`` is the undropped one); the keep-mask of a tile is drawn
from its rows' keys (:func:`task_keys`, once per task) and its keys' global columns, so it is
the same whatever the tile, the task or the thread.

With the ``fast`` extra (float32, C-contiguous tiles) the softcap, the exponential, the row
sums and the keep-mask are one compiled pass (:mod:`.compiled`'s ``mod_exp2_sum`` and
``mod_grad_exp2``) where no bias or user mask has to come between the softcap and the
exponential, and two passes where one does; otherwise each is a NumPy step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import score_ops
from . import exp2 as pow2
from .tiles import LOG2E, batch_of, mask_and_bias, structural

_FAR = 1 << 62


@dataclass(frozen=True, slots=True)
class Mods:
    """A call's softcap (``cap``: ``c`` in natural units, or None) and dropout (``p`` > 0 or 0)."""

    spec: object
    cap: float | None
    p: float
    dt: np.dtype

    @property
    def cap2(self) -> float:
        """The cap of a base-2 tile, ``log2(e)·c`` (0: none)."""
        return 0.0 if self.cap is None else self.cap * LOG2E

    @property
    def zscale(self):
        return self.dt.type(1.0 / (1.0 - self.p))


def of(spec, dt) -> Mods | None:
    """The call's :class:`Mods`, or None where the scores are plain (no softcap, no dropout)."""
    if spec.plain_scores:
        return None
    return Mods(spec, spec.softcap, spec.dropout_p, np.dtype(dt))


@dataclass(frozen=True, slots=True)
class Keys:
    """The row keys of a task's stacked rows (head after head), whole and as 32-bit halves."""

    k64: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def rows(self, i0: int, i1: int) -> "Keys":
        return Keys(self.k64[i0:i1], self.lo[i0:i1], self.hi[i0:i1])


def task_keys(mods: Mods | None, heads: list, q0: int, q1: int) -> Keys | None:
    """Row keys of rows ``q0:q1`` of each of ``heads``, stacked; None without dropout."""
    if mods is None or not mods.p:
        return None
    k = np.concatenate([score_ops.keys(mods.spec, q0, q1, h) for h in heads])
    return Keys(k, (k & np.uint64(0xFFFFFFFF)).astype(np.uint32), (k >> np.uint64(32)).astype(np.uint32))


def _compiled(x: np.ndarray):
    c = pow2._choose()
    return c.compiled if c.takes(x) else None


def cap(mods: Mods, st: np.ndarray, unit: float = LOG2E, g: np.ndarray | None = None) -> None:
    """``st = C·tanh(st / C)`` in place, ``C = unit·c`` (``unit`` 1.0: natural units); with
    ``g`` also ``g = 1 - tanh²`` (the backward's slope)."""
    if mods.cap is None:
        return
    c2 = mods.cap * unit
    comp = _compiled(st) if g is None or g.flags.c_contiguous else None
    if comp is not None:
        comp.softcap_tile(st, st if g is None else g, np.float32(c2), g is not None)
        return
    t = st.dtype.type(c2)
    np.divide(st, t, out=st)
    np.tanh(st, out=st)
    if g is not None:
        np.multiply(st, st, out=g)
        np.subtract(1, g, out=g)
    np.multiply(st, t, out=st)


def drop(mods: Mods, p: np.ndarray, keys: Keys, col0: int, out: np.ndarray | None = None) -> np.ndarray:
    """``P ∘ Z`` of a tile ``p (keys, rows)`` whose first key is global column ``col0``:
    in place, or into ``out``."""
    z = score_ops.keep_scale(keys.k64[:, None], col0 + np.arange(p.shape[0], dtype=np.int64), mods.p, p.dtype).T
    return np.multiply(p, z, out=p if out is None else out)


def exp_sum_drop(mods: Mods, st: np.ndarray, m, l, keys: Keys | None, col0: int) -> None:
    """``st = 2^(st - m)`` with ``l += Σ_keys`` (undropped), then ``st ∘= Z`` with dropout."""
    comp = _compiled(st)
    if comp is not None and keys is not None:
        m = np.zeros(st.shape[1], np.float32) if m is None else m.astype(np.float32, copy=False)
        comp.mod_exp2_sum(st, m, l, np.float32(0.0), 0, 0, 0, _FAR, _FAR,
                          keys.lo, keys.hi, col0, np.uint32(score_ops.threshold(mods.p)), mods.zscale, True)
        return
    pow2.sub_exp2(st, m, l)
    if keys is not None:
        drop(mods, st, keys, col0)


def bound_tile(mods: Mods, st, m, l, spec, heads, rows, a: int, b: int, keys: Keys | None) -> None:
    """The bound path's tile (:func:`.forward_kernel._bound_tile`): softcap, masks, ``2^(s - m)``
    and ``Σ`` into ``l``, dropout, in place on ``st (b-a, r)`` for ``rows = (r0, r1, partial)``."""
    r0, r1, partial_ = rows
    comp = _compiled(st)
    fused = spec.alibi is None and (not partial_ or (len(heads) == 1 and structural(spec)))
    if comp is not None and fused:
        lo, hi = spec.band if partial_ else (None, None)
        k = keys if keys is not None else _NO_KEYS
        comp.mod_exp2_sum(st, np.zeros(st.shape[1], np.float32) if m is None else m.astype(np.float32, copy=False),
                          l, np.float32(mods.cap2), a, r0, spec.shift(batch_of(spec, heads[0])),
                          _FAR if lo is None else lo, _FAR if hi is None else hi, k.lo, k.hi,
                          spec.k_start + a, np.uint32(score_ops.threshold(mods.p)), mods.zscale, keys is not None)
        return
    cap(mods, st)
    if partial_ or spec.alibi is not None:
        mask_and_bias(st, spec, heads, r0, r1, a, b, partial_)
    exp_sum_drop(mods, st, m, l, keys, spec.k_start + a)


_NO_KEYS = Keys(np.zeros(1, np.uint64), np.zeros(1, np.uint32), np.zeros(1, np.uint32))  # never read: drop off


# --- the backward's tile -------------------------------------------------------------------------
def keep_tile(mods: Mods, keys: Keys, col0: int, w: int, out: np.ndarray) -> np.ndarray:
    """``Z (w, rows)`` of ``w`` keys from global column ``col0`` against the rows of ``keys``."""
    z = score_ops.keep_scale(keys.k64[:, None], col0 + np.arange(w, dtype=np.int64), mods.p, out.dtype)
    np.copyto(out, z.T)
    return out


def grad_probs(call, kv, qh, h, q0, q1, a, e, partial_, whole, et, g, z):
    """The fast path's ``P`` of a tile into ``et (w, r)`` (and ``g = P ∘ (1 - tanh²)`` with softcap,
    ``z = Z`` with dropout); returns P's row sums where ``whole``, else None. Without softcap
    ``S - lse`` rides in the product as in :mod:`.backward_kernel`; with it the product gives
    ``log2(e)·x``, capped before the bias, masks and the ``-lse`` subtraction."""
    mods, d = call.mods, qh.q.shape[-1]
    keys = None if qh.keys is None else qh.keys.rows(q0, q1)
    capped = mods.cap is not None
    if capped:
        np.matmul(kv.kx[a:e, :d], qh.qx[q0:q1, :d].T, out=et)    # (w,D) @ (D,r) -> (w,r): log2(e)·xᵀ
    else:
        np.matmul(kv.kx[a:e], qh.qx[q0:q1].T, out=et)            # (w,D+2) @ (D+2,r): (S - lse)ᵀ
    nhi, nlo = np.ascontiguousarray(qh.qx[q0:q1, d]), np.ascontiguousarray(qh.qx[q0:q1, d + 1])  # strided: scalar loops
    comp = _compiled(et)
    if comp is not None and not (partial_ or call.masked):
        r = np.zeros(q1 - q0 if whole else 0)                 # no row sums unless the tile holds the rows' every key
        k = keys if keys is not None else _NO_KEYS
        zero = np.zeros(q1 - q0, et.dtype)
        comp.mod_grad_exp2(et, z, g, nhi if capped else zero, nlo if capped else zero, r, np.float32(mods.cap2),
                           k.lo, k.hi, call.spec.k_start + a, np.uint32(score_ops.threshold(mods.p)),
                           mods.zscale, keys is not None)
        return r if whole else None
    if capped:
        cap(mods, et, LOG2E, g)
    if partial_ or call.masked:
        mask_and_bias(et, call.spec, [h], q0, q1, a, e, partial_, LOG2E, call.clip)
    if capped:
        et += nhi                                               # S - lse, -lse in two exact parts
        et += nlo
    r = np.zeros(q1 - q0) if whole else None
    pow2.sub_exp2(et, None, r)                                  # P = exp(S - lse), r_i = Σ_j P_ij
    if capped:
        g *= et                                                 # P ∘ (1 - tanh²), as the compiled pass
    if keys is not None:
        keep_tile(mods, keys, call.spec.k_start + a, e - a, z)
    return r


def grad_scores(call, kv, qh, et, g, z, dst, dob, whole, r, q0, q1, a, e):
    """``dSᵀ`` of a tile into ``dst`` from ``Pᵀ`` (``et``), ``Z`` and ``g = P ∘ (1 - tanh²)``:
    ``dS = P ∘ (Z ∘ dO Vᵀ - delta + dlse) ∘ (1 - tanh²)`` (the whole-tile correction of
    :func:`.backward_kernel._grad_tile` included); returns ``(P ∘ Z)ᵀ`` for dV."""
    mods, dv = call.mods, qh.dox.shape[-1] - 1
    np.matmul(kv.v1[a:e, :dv], dob[:, :dv].T, out=dst)          # (w,Dv) @ (Dv,r): dO Vᵀ
    f = et if mods.cap is None else g
    comp = None if whole else _compiled(dst)
    if comp is not None and f.flags.c_contiguous and z.flags.c_contiguous and et.flags.c_contiguous:
        comp.scores_grad(dst, z, np.ascontiguousarray(dob[:, dv]), f, et, bool(mods.p))  # the steps below in
        return z if mods.p else et                              # one pass, rounded as they are; z: P ∘ Z
    if mods.p:
        dst *= z                                                # ∂L/∂P = Z ∘ dO Vᵀ
    dst += dob[:, dv]                                           # - delta + dlse (over r on a whole tile)
    if whole:
        c = np.einsum("wr,wr->r", et, dst, dtype=np.float64)    # see backward_kernel._grad_tile
        if qh.dlse is not None:
            c -= qh.dlse[q0:q1]
        dst -= (c / np.where(r > 0, r, 1)).astype(call.dt)
    ez = et
    if mods.p:
        ez = np.multiply(et, z, out=z)                          # P ∘ Z, for dV
    # dS = P ∘ (dP - delta), through the softcap dX = dS ∘ (1 - tanh²): g holds P ∘ (1 - tanh²)
    dst *= f
    return ez
