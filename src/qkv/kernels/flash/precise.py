"""Which rows take the precise path, and the sums the backward normalises them by.

The forward redoes a task on its precise path (float64 scores in natural units) where a
row's ``lse`` says its largest score is beyond ``±LARGE`` (:func:`large_rows`; the reason is
in :mod:`.forward_kernel`'s docstring). The backward applies the same test to the saved
``lse``, adds the rows whose score terms may be large (:func:`precise_rows`, with
:func:`key_norm_max`), and normalises those rows by their own maximum and sum
(:class:`RowNorm`) rather than by ``lse`` (see :mod:`.backward_kernel`). A caller that holds
the keys in blocks (the ring) chooses the rows once for the whole sequence and adds up the
sums over all blocks.

Row by row: a row is precise by its own ``lse``, its own ``q`` and the largest norm of the
keys *it* may see (:func:`own_precise_rows`, :mod:`.rows_bound`), and a tile that holds
precise rows beside others computes both paths and gives each row its own
(:func:`take_rows`), so no row's bits depend on another's path, nor on keys it may not see.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import jit
from ...masks import MaskSpec
from . import exp2 as pow2
from . import rows_bound
from .tiles import LOG2E, batch_of, kv_heads

# A row maximum beyond ±LARGE (read from lse) takes the precise path; see large_rows.
LARGE = {np.dtype(np.float32): 16.0, np.dtype(np.float64): 16.0}


def large_rows(lse: np.ndarray, tk: int, dt) -> np.ndarray:
    """Rows whose ``lse`` says their largest score is beyond ``±LARGE`` (``lse <= max + log Tk``).
    NaN and ``-inf`` (a NaN input, a row that sees nothing) are not large."""
    big = LARGE[np.dtype(dt)]
    return (lse > big + math.log(tk)) | ((lse < -big) & (lse > -np.inf))  # NaN compares False, quietly


def lse_of(m, l, unit) -> np.ndarray:
    """``(m + log l) / unit`` in float64 (log in base e^unit), ``-inf`` where l = 0."""
    m, l = np.asarray(m, np.float64), np.asarray(l, np.float64)
    seen = l != 0
    log = np.log2 if unit != 1.0 else np.log
    return np.where(seen, (np.where(seen, m, 0) + log(np.where(seen, l, 1))) / unit, -np.inf)


# Rows whose score terms may reach this size (Cauchy–Schwarz: scale·‖q_i‖·max‖k_j‖) take the
# precise path too: a float score carries an error of about eps times its terms, and a row
# with one dominant key would show it in full (its P should be exactly 1).
TERMS = {np.dtype(np.float32): 32.0, np.dtype(np.float64): 32.0}


@dataclass
class RowNorm:
    """Running ``m`` (row maximum of the float64 scores) and ``l = Σ exp(x - m)`` of every
    query row, shape ``(*L, Tq)``; ``m = -inf``, ``l = 0`` where no key was seen yet."""

    m: np.ndarray
    l: np.ndarray

    @classmethod
    def empty(cls, shape: tuple) -> "RowNorm":
        return cls(np.full(shape, -np.inf), np.zeros(shape))

    def add(self, index, rows: slice, x_max: np.ndarray, x_sum_at) -> None:
        """Fold in one tile: ``x_max`` its row maxima, ``x_sum_at(m_new)`` its Σ exp(x - m_new)."""
        m, l = self.m[index][rows], self.l[index][rows]
        m_new = np.maximum(m, x_max)
        safe = np.where(m_new == -np.inf, 0, m_new)
        self.l[index][rows] = l * np.exp(m - safe) + x_sum_at(safe)
        self.m[index][rows] = m_new

    def merge(self, other: "RowNorm") -> "RowNorm":
        """The sums over both key sets (disjoint ones: another lane's, another block's)."""
        m = np.maximum(self.m, other.m)
        safe = np.where(m == -np.inf, 0, m)
        with np.errstate(under="ignore"):
            l = self.l * np.exp(self.m - safe) + other.l * np.exp(other.m - safe)
        return RowNorm(m, l)

    def rows(self, sl: slice) -> "RowNorm":
        return RowNorm(self.m[..., sl], self.l[..., sl])


def key_norm_max(k: np.ndarray, spec: MaskSpec, group: int) -> np.ndarray:
    """``max_j ‖k_j‖`` over the keys each query head may read (inside its ``kv_lengths``),
    shape ``lead = (*L,)``; float64."""
    tk = k.shape[-2]
    with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything; never read
        norms = {ikv: np.sqrt(np.einsum("td,td->t", k[ikv], k[ikv], dtype=np.float64))
                 for ikv, _ in kv_heads(k.shape[:-2], group)}
    kmax = np.zeros(spec.lead)
    for ikv, heads in kv_heads(k.shape[:-2], group):
        for h in heads:
            n = tk if spec.kv_lengths is None else int(spec.kv_lengths[batch_of(spec, h)])
            kmax[h] = norms[ikv][:n].max(initial=0.0)
    return kmax


def precise_rows(q: np.ndarray, lse: np.ndarray, spec: MaskSpec, scale: float,
                 kmax: np.ndarray) -> np.ndarray:
    """Bool ``(*L, Tq)``: the rows that take the precise path (see the module docstring).
    ``spec.tk`` is the row's whole key count and ``kmax`` the largest key norm it may meet,
    over all keys, also those of other calls: a head's (from :func:`key_norm_max`, shape
    ``(*L,)``) or each row's own (``(*L, Tq)``, :func:`own_precise_rows`)."""
    dt = np.dtype(q.dtype)
    tq = q.shape[-2]
    real = np.arange(tq) < np.reshape([spec.rows(batch_of(spec, h)) for h in np.ndindex(*spec.lead)],
                                      spec.lead + (1,))  # padding rows are never precise
    finite = (lse != -np.inf) & real
    qnorm = np.sqrt(np.einsum("...td,...td->...t", q, q, dtype=np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        terms = abs(scale) * qnorm * (kmax if kmax.ndim == qnorm.ndim else kmax[..., None])
        # log2(e)·scale·q must fit the dtype on the fast path
        overflow = np.abs(q).max(axis=-1).astype(np.float64) * abs(scale) * LOG2E > float(np.finfo(dt).max)
    return (large_rows(lse, spec.tk, dt) | (terms > TERMS[dt]) | overflow) & finite


def own_precise_rows(q, k, lse, spec: MaskSpec, scale: float, group: int) -> np.ndarray:
    """:func:`precise_rows` with each row's own ``kmax`` (the keys it may see, this call's):
    first by each head's largest key (rows it leaves out stay out: their own is no larger),
    then, in the heads where some row is chosen, by the rows' own."""
    kmax = key_norm_max(k, spec, group)
    precise = precise_rows(q, lse, spec, scale, kmax)
    if not precise.any():
        return precise
    own = np.broadcast_to(kmax[..., None], precise.shape).copy()
    for ikv, heads in kv_heads(k.shape[:-2], group):
        heads = [h for h in heads if precise[h].any()]
        if heads:
            with np.errstate(over="ignore", invalid="ignore"):  # padding may hold anything; never read
                norms = np.sqrt(np.einsum("td,td->t", k[ikv], k[ikv], dtype=np.float64))
        for h in heads:
            own[h] = rows_bound.row_kmax(spec, norms, [h], 0, q.shape[-2], (0, spec.keys(batch_of(spec, h))))
    return precise_rows(q, lse, spec, scale, own)


def offsets(lse, precise, norm: RowNorm):
    """``(m, log l)`` per row for the precise tiles: the row's own sums where it is precise,
    ``(lse, 0)`` for its other rows (P = exp(S - lse) in float64), ``(0, 0)`` where it saw nothing."""
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(precise, norm.m, np.where(lse == -np.inf, 0, lse)).astype(np.float64)
        log_l = np.where(precise, np.log(np.where(norm.l > 0, norm.l, 1)), 0.0)
    return np.where(np.isfinite(m), m, 0), log_l


def shifted(x: np.ndarray, m: np.ndarray, out: np.ndarray, n: np.ndarray | None = None, f: float = 1.0) -> None:
    """``out = ((x · f) - m) - n`` (``n`` None: ``x · f - m``), the float64 tile ``x (keys, rows)``
    less each row's offsets, rounded to ``out``'s dtype (a difference beyond its range: ``-inf``,
    whose exp is 0); ``x`` is left undefined. One compiled pass where the ``fast`` extra is
    (:mod:`.precise_compiled`), NumPy's bits."""
    c = jit.load(jit.PRECISE)
    if c is None or not (x.flags.c_contiguous and out.flags.c_contiguous):
        with np.errstate(over="ignore"):
            if f != 1.0:
                x *= f
            x -= m
            if n is not None:
                x -= n
            np.copyto(out, x)
        return
    c.shifted(x, float(f), np.ascontiguousarray(m, np.float64), None if n is None else np.ascontiguousarray(n, np.float64),
              1.0, out)


def exp_shifted(x: np.ndarray, m: np.ndarray, out: np.ndarray, n: np.ndarray | None = None, f: float = 1.0,
                l: np.ndarray | None = None) -> None:
    """``out = exp(((x · f) - m) - n)`` of the float64 tile ``x (keys, rows)`` in ``out``'s dtype
    (``x`` left undefined), and ``l[j] += Σ_i out[i, j]`` (float64) where ``l`` is given.

    float32 with the ``fast`` extra: the exponent in float64, times ``log2(e)``, rounded once to
    float32 (:mod:`.precise_compiled`), then the tiled kernel's compiled ``2^x`` with the sums in
    its pass (:func:`.exp2.sub_exp2`: about 1 ulp, exactly 1 at 0, so a row's largest score
    gives exactly 1). Else the difference rounded to ``out``'s dtype and NumPy's ``exp``."""
    c = jit.load(jit.PRECISE)
    if out.dtype == np.float32 and c is not None and pow2.path() == "numba" \
            and x.flags.c_contiguous and out.flags.c_contiguous:
        c.shifted(x, float(f), np.ascontiguousarray(m, np.float64),
                  None if n is None else np.ascontiguousarray(n, np.float64), LOG2E, out)
        if l is None:
            pow2.exp2(out)
        else:
            pow2.sub_exp2(out, None, l)
        return
    shifted(x, m, out, n, f)
    np.exp(out, out=out)
    if l is not None:
        l += out.sum(axis=0, dtype=np.float64)


def later_scale(scale: float, plain: bool) -> float:
    """The factor a precise tile's consumers apply themselves (:func:`shifted`'s ``f``, the row
    maximum times it): ``scale`` where the tile needs nothing but the scale (``plain``: no bias,
    ALiBi or softcap; a mask's ``-inf`` stays ``-inf`` either way) and it is positive, so that
    ``max_j fl(x_j·scale) = fl(scale·max_j x_j)`` (rounding keeps order); else 1, the tile
    scaled at once."""
    return scale if plain and scale > 0 else 1.0


def take_rows(rows: np.ndarray, fast: tuple, exact: tuple) -> tuple:
    """A tile's ``(Pᵀ, dSᵀ (keys, rows), [dO | -delta] (rows, Dv+1))`` with the ``exact``
    (precise) path's columns where ``rows`` (bool), the ``fast`` one's elsewhere: in place
    in ``exact``'s tiles (scratch), a new ``[dO | -delta]``."""
    et, dst, dob = exact
    np.copyto(et, fast[0], where=~rows)                      # (w, r): a column a row
    np.copyto(dst, fast[1], where=~rows)
    return et, dst, np.where(rows[:, None], dob, fast[2])
