"""A key a row may not see never reaches it, whatever k or v hold there: every kernel's guard.

A kernel multiplies whole blocks: ``O = P V`` reads ``v_j`` for every key of the block, and
``P_ij = 0`` at a key hidden by ``causal``, ``window``, ``chunk``, ``mask`` or a ``-inf``
bias still gives ``0 · NaN = NaN`` (the dense paths: every row; the tiled and row kernels:
the rows of the same tile or block); in the backward ``dP = dO Vᵀ`` puts the NaN into
``dS_ij`` at hidden keys, and ``dQ = dS K`` reads a hidden ``k_j`` the same way. flash-attn's
kernels skip such keys; here, where k or v holds a NaN or an inf, the kernel runs on copies
with those entries 0, and the rows that may see one get what the arithmetic gives them
(:class:`_Poison`):

- ``out_id``: NaN where the row sees a NaN in ``v[:, d]`` (or infs of both signs there),
  ``±inf`` where it sees infs of one sign (as a positive weight times inf: a weight that
  underflowed to 0 would give NaN);
- a row that sees a non-finite entry of ``k`` (its score NaN or ±inf): out and lse NaN;
- backward: dq NaN on those rows; dk NaN at the keys such a row sees (its ``dS_ij`` are NaN
  there), dv NaN at the keys a row of NaN scores sees (its ``P_ij`` are). Every other
  gradient is the kernel's on the zeroed copies, with ``dS_ij = 0`` exactly where the key is
  hidden (``P_ij = 0``): the backward reruns the kernel's forward on the copies, so each
  poisoned row's ``P`` and ``Δ`` are finite.

Padding past ``kv_lengths`` is hidden the same way (the kernels also zero it themselves).

Cost where nothing is wrong (the fast path): one BLAS pass over k and one over v before the
forward and again before the backward (:func:`_finite_norms`; the bounds also serve
:mod:`.magnitudes`, whose check adds a pass over q, and in the backward over dO and O). Measured at (12, 4, 64, 32)
float32 on 2 shared cores: 11-27 µs a check, forward + backward causal 1.20-1.42 ms with the
fast extra (the two checks 2-4 %), 1.9-2.5 ms without (1-2 %). (Checking the forward's out
instead, half the bytes, misses a bad entry of k whose score is -inf: a row that sees it
must get NaN as on the careful path, not a weight of 0.)
"""
from __future__ import annotations

import math

import numpy as np

from ..masks import MaskSpec
from . import magnitudes

ROWS_AT_ONCE = 256   # query rows whose visibility is made at a time (a (…, rows, Tk) bool array)


def _finite_norms(k: np.ndarray, v: np.ndarray) -> tuple | None:
    """k's and v's :func:`.magnitudes.norm_bound` when every entry of k and v is finite, else
    None. Where ``Σx²`` is finite so is every entry (a NaN or inf entry makes the sum NaN or
    inf): one BLAS pass an array, 6.5 µs at (12, 4, 64, 32) float32. A sum that is not finite
    (finite terms may overflow) or that BLAS cannot take in one pass (the heads of a layer's
    projection, seen in place) says nothing, and the bound is taken from the max and the min,
    which say it too: one pair of passes an array, kept for :mod:`.magnitudes` (which asked
    them again before, twice for v in a backward)."""
    norms = tuple(magnitudes.norm_bound(x) for x in (k, v))
    return norms if all(math.isfinite(n) for n in norms) else None


def forward(impl, q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False, **kw):
    """``impl.forward`` (the kernel interface of :mod:`.reference`) with hidden keys kept out."""
    norms = _finite_norms(k, v)
    if norms is not None:
        return magnitudes.forward(impl, q, k, v, spec, scale, group, return_weights, norms, **kw)
    bad = _Poison(q, k, v, spec, scale, group)
    out, lse, weights = magnitudes.forward(impl, q, bad.k, bad.v, spec, scale, group, return_weights, **kw)
    return bad.forward(out, lse, weights)


def backward(impl, dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None, **kw):
    """``impl.backward`` with hidden keys kept out (module docstring)."""
    norms = _finite_norms(k, v)
    if norms is not None:
        return magnitudes.backward(impl, dout, q, k, v, out, lse, spec, scale, group, dlse, norms, **kw)
    bad = _Poison(q, k, v, spec, scale, group)
    out_c, lse_c, _ = magnitudes.forward(impl, q, bad.k, bad.v, spec, scale, group, False)   # finite P and Δ on the copies
    rows = bad.rows_k | bad.rows_v
    out = np.where(rows[..., None], out_c, out).astype(out.dtype, copy=False)
    lse = np.where(rows, lse_c, lse).astype(lse.dtype, copy=False)
    res = magnitudes.backward(impl, dout, q, bad.k, bad.v, out, lse, spec, scale, group, dlse, **kw)
    return bad.backward(*res[:3]) + tuple(res[3:])


class _Poison:
    """The non-finite entries of ``k (*Lk, Tk, D)`` and ``v (*Lk, Tk, Dv)`` (kv head ``h //
    group`` serves query head ``h`` of ``q (*L, Tq, D)``): the zeroed copies ``k``, ``v``, and
    which rows see them (``rows_k``, ``rows_v``: ``(*L, Tq)``)."""

    def __init__(self, q, k, v, spec: MaskSpec, scale: float, group: int):
        fk, fv = np.isfinite(k), np.isfinite(v)
        self.k = np.where(fk, k, 0).astype(k.dtype, copy=False)
        self.v = np.where(fv, v, 0).astype(v.dtype, copy=False)
        self.spec, self.group = spec, group
        bad_k = ~fk.all(axis=-1)                                           # (*Lk, Tk)
        bad_v = ~fv.all(axis=-1)
        self.cols = np.flatnonzero((bad_k | bad_v).reshape(-1, bad_k.shape[-1]).any(axis=0))   # the keys concerned
        vis = self._visible(self.cols)                                     # (*L, Tq, J)
        self.rows_k = (vis & self._heads(bad_k[..., self.cols])[..., None, :]).any(axis=-1)
        self.rows_v = (vis & self._heads(bad_v[..., self.cols])[..., None, :]).any(axis=-1)
        vj = self._heads(v[..., self.cols, :])                             # (*L, J, Dv)
        visf = vis.astype(np.float32)
        with np.errstate(invalid="ignore"):
            self.nan = np.matmul(visf, np.isnan(vj)) > 0                  # (*L,Tq,J) @ (*L,J,Dv) -> (*L,Tq,Dv)
            self.pos = np.matmul(visf, vj == np.inf) > 0
            self.neg = np.matmul(visf, vj == -np.inf) > 0

    def _heads(self, x: np.ndarray) -> np.ndarray:
        """``x (*Lk, ...)`` of kv heads as ``(*L, ...)`` of query heads (a kv head for each of its group)."""
        nd = len(self.spec.lead)
        if self.group > 1:
            x = np.repeat(x, self.group, axis=nd - 1)
        return np.broadcast_to(x, self.spec.lead + x.shape[nd:])

    def _visible(self, cols: np.ndarray) -> np.ndarray:
        """``(*L, Tq, len(cols))`` bool: row i may see key ``cols[j]`` (mask rules, and no -inf bias)."""
        spec = self.spec
        out = np.empty(spec.lead + (spec.tq, len(cols)), bool)
        for q0 in range(0, spec.tq, ROWS_AT_ONCE):
            out[..., q0:q0 + ROWS_AT_ONCE, :] = self._seen(q0, min(q0 + ROWS_AT_ONCE, spec.tq))[..., cols]
        return out

    def _seen(self, q0: int, q1: int) -> np.ndarray:
        """``(*L, q1 - q0, Tk)`` bool: which keys rows q0:q1 may see."""
        spec = self.spec
        ok = spec.allowed(q0, q1)
        ok = np.ones((q1 - q0, spec.tk), bool) if ok is None else ok
        add = spec.additive(q0, q1)
        if add is not None:
            ok = ok & (add != -np.inf)
        return np.broadcast_to(ok, spec.lead + (q1 - q0, spec.tk))

    def forward(self, out, lse, weights):
        """The kernel's results on the copies, with what the rows that see a bad entry get."""
        out = np.where(self.pos & ~self.neg, np.inf, out)
        out = np.where(self.neg & ~self.pos, -np.inf, out)
        out = np.where(self.nan | (self.pos & self.neg) | self.rows_k[..., None], np.nan, out).astype(out.dtype)
        lse = np.where(self.rows_k, np.nan, lse).astype(lse.dtype)
        if weights is not None:
            weights = np.where(self.rows_k[..., None], np.nan, weights).astype(weights.dtype)
        return out, lse, weights

    def backward(self, dq, dk, dv):
        """The kernel's gradients on the copies, NaN where a row that sees a bad entry puts it."""
        rows = self.rows_k | self.rows_v
        dq = np.where(rows.reshape(rows.shape + (1,) * (dq.ndim - rows.ndim)), np.nan, dq).astype(dq.dtype)
        keys_k, keys_v = self._keys_seen(rows), self._keys_seen(self.rows_k)     # (*Lk, Tk)
        dk = np.where(keys_k[..., None], np.nan, dk).astype(dk.dtype)
        dv = np.where(keys_v[..., None], np.nan, dv).astype(dv.dtype)
        return dq, dk, dv

    def _keys_seen(self, rows: np.ndarray) -> np.ndarray:
        """``(*Lk, Tk)`` bool: keys that some row of ``rows (*L, Tq)`` may see, over each kv head's group."""
        spec = self.spec
        seen = np.zeros(spec.lead + (spec.tk,), bool)
        if rows.any():
            for q0 in range(0, spec.tq, ROWS_AT_ONCE):
                q1 = min(q0 + ROWS_AT_ONCE, spec.tq)
                seen |= (self._seen(q0, q1) & rows[..., q0:q1, None]).any(axis=-2)
        if self.group > 1:
            nd = len(spec.lead)
            seen = seen.reshape(spec.lead[:-1] + (spec.lead[-1] // self.group, self.group, spec.tk)).any(axis=nd)
        return seen
