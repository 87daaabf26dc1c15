"""The tiled backward's prepared operands: the fixed facts of a call, and each head's rows
and keys with the extra columns that fold ``S - lse`` and ``dP - delta`` into the products
(see :mod:`.backward_kernel`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...masks import MaskSpec
from . import modifiers
from .precise import later_scale
from .tiles import LOG2E, Tiles, batch_of


@dataclass
class Call:
    """The fixed facts of one backward call."""

    spec: MaskSpec
    scale: float
    tk: int
    dt: np.dtype
    tiles: Tiles
    whole_rows: bool      # the call's keys are all of each row's keys (not a ring block)
    masked: bool          # a bias or ALiBi adds to the scores
    clip: float | None    # the fast path's bias clip (see tiles.bias_limit)
    mods: modifiers.Mods | None = None   # softcap and dropout (qkv.score_ops); None: plain scores

    @property
    def later(self) -> float:
        """The scale that a precise tile's consumers apply themselves (:func:`.precise.later_scale`)."""
        return later_scale(self.scale, self.mods is None and not self.masked)


@dataclass
class QueryHead:
    """One query head's rows, with the backward's extra columns."""

    qx: np.ndarray | None   # (Tq, D+2)  [log2(e)·scale·Q | -hi | -lo]
    dox: np.ndarray | None  # (Tq, Dv+1) [dO | dlse - delta], zero on rows that saw nothing
    q: np.ndarray           # (Tq, D) Q, contiguous, for dK = scale · dSᵀ Q
    precise: np.ndarray     # (Tq,) bool
    q64: np.ndarray | None  # (Tq, D) float64 Q where some row is precise
    dlse: np.ndarray | None = None  # (Tq,) the gradient of lse, where given
    keys: modifiers.Keys | None = None  # (Tq,) the rows' dropout keys, where dropout is on
    resid: np.ndarray | None = None  # (Tq,) c_i = Σ_j P_ij d_ij over every key, where peaked (else 0)


@dataclass
class KVHead:
    kx: np.ndarray | None   # (Tk, D+2) [K | 1 | 1]
    v1: np.ndarray | None   # (Tk, Dv+1) [V | 1]
    k64: np.ndarray | None  # (Tk, D) float64 K where some query row is precise


def prep_q(call: Call, h, q, precise, dout=None, out=None, lse=None, dlse=None) -> QueryHead:
    """A query head's operands; without ``dout`` only what :func:`row_sums` reads."""
    dt, d = call.dt, q.shape[-1]
    exact = precise[h]
    q64 = q[h].astype(np.float64) if exact.any() else None
    if dout is None:
        return QueryHead(None, None, q[h], exact, q64)
    ls, tq, dv = lse[h], q.shape[-2], dout.shape[-1]
    finite = (ls != -np.inf) & (np.arange(tq) < call.spec.rows(batch_of(call.spec, h)))
    qx = np.empty((tq, d + 2), dt)                                # [log2(e)·scale·Q | -hi | -lo]
    with np.errstate(over="ignore"):
        np.multiply(q[h], dt.type(call.scale * LOG2E), out=qx[:, :d])
    t = np.where(finite & ~exact, ls, 0).astype(np.float64) * LOG2E  # log2(e)·lse = hi + lo exactly
    qx[:, d] = -t                                                 # -hi: t rounded to the dtype
    qx[:, d + 1] = -(t + qx[:, d].astype(np.float64))             # -lo = -(t - hi), exact in float64
    delta = np.einsum("td,td->t", dout[h], out[h])                # delta_i = rowsum(dO_i ∘ O_i)
    dl = None if dlse is None else np.where(finite, dlse[h], 0)
    dox = np.empty((tq, dv + 1), dt)                              # [dO | dlse - delta], riding in dP
    dox[:, :dv] = np.where(finite[:, None], dout[h], 0)           # rows that saw nothing: zero
    dox[:, dv] = np.where(finite, -delta if dl is None else dl - delta, 0)
    return QueryHead(qx, dox, np.ascontiguousarray(q[h]), exact, q64, dl,
                     modifiers.task_keys(call.mods, [h], 0, tq))


def prep_kv(call: Call, ikv, k, v, any_precise: bool, sums_only: bool = False) -> KVHead:
    k64 = k[ikv].astype(np.float64) if any_precise else None
    if sums_only:
        return KVHead(None, None, k64)
    tk, d, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    kx = np.empty((tk, d + 2), call.dt)                           # [K | 1 | 1]
    kx[:, :d] = k[ikv]
    kx[:, d:] = 1
    v1 = np.empty((tk, dv + 1), call.dt)                          # [V | 1]
    v1[:, :dv] = v[ikv]
    v1[:, dv] = 1
    return KVHead(kx, v1, k64)
