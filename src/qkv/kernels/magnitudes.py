"""Huge finite inputs: every kernel's arithmetic kept inside the dtype by exact powers of two.

Three products of a kernel can overflow although the answer is finite in the dtype:

- the scores' product ``q·k`` before the scale (``q = k = 1e19``, ``scale = 1/4`` in float32:
  ``q·k = 4e38`` overflows, the scaled score ``1e38`` does not);
- the forward's sums ``Σ_j p_j v_j``: a kernel that normalises after summing (the tiled and
  the NumPy row kernels) adds up to ``Tk·max|v|`` times its largest weight, ``2^64`` in the
  NumPy row kernel (``Tk = 2048, v = 1e36``: inf, the answer ``1e36``);
- the backward's ``dP = dO Vᵀ`` and ``delta = rowsum(dO ∘ O)``, up to ``Dv·max|dO|·max|v|``
  each (``v = 1e37, Dv = 64``: ``dP - delta`` is ``inf - inf``), and ``dV = Pᵀ dO``.

Each is linear in one operand, so the operand is scaled by ``2^-e`` before the kernel and the
result by ``2^e`` after it, which is exact (a power of two moves the exponent only; an entry
that drops below the dtype's normal range, ``2^(e-126)`` in float32, loses bits):

- ``s = scale·(q·k) = (scale·2^e)·((q·2^-e)·k)``: the kernel gets ``q·2^-e`` and ``scale·2^e``,
  out and lse are the same numbers, and ``dq`` comes back times ``2^e`` (``∂s/∂q'``), so it is
  scaled by ``2^-e``; dk is the same numbers;
- out is linear in v: the kernel gets ``v·2^-e`` and out comes back times ``2^-e``;
- (dq, dk, dv) are linear in (dO, dlse): the kernel gets both times ``2^-e``.

``e = 0`` (the kernel called as it was, the same bits) wherever the bounds are far from the
dtype's top. The bounds: ``|q_i·k_j| <= ‖q_i‖‖k_j‖`` (every partial sum too), ``|Σ_j p_j v_j|
<= 2^64·Tk·max|v|``, ``|dP_ij|, |delta_i| <= ‖dO_i‖·max‖v_j‖`` (over ``1 - p`` with dropout), ``|dV_j| <= Tq·G·max|dO|``.
The check first asks the cheap Frobenius norms ``Σx²`` (one pass an array, which also says
every entry is finite: :func:`norm_bound`); only where one is large or not finite are the
maxima ``max|x|`` taken (two passes), and only where those are large is anything scaled.
"""
from __future__ import annotations

import math

import numpy as np

from ..masks import MaskSpec

HEADROOM = 2.0 ** -3   # a bound may reach this fraction of the dtype's largest number
TERMS = 2.0 ** 64      # the largest weight a forward sums before it normalises (the NumPy row
#                        kernel's, rows.numpy_rows.HUGE; the tiled bound path's larger ones are
#                        checked and redone there with weights <= 1)


def square_sum(x: np.ndarray) -> float:
    """``Σ x²`` in the array's dtype, one pass (inf where it overflows, NaN or inf where an entry
    is not finite): BLAS's dot where x is C-contiguous, else einsum's over the view in place (a
    head cut out of ``(B, T, 3, H, D)``: 15 µs at (12, 4, 64, 32) float32, where the two passes of
    a max and a min took 42 and a copy for BLAS 32; a broadcast view counts an entry as often as
    it appears, which bounds its rows all the same)."""
    if x.size == 0:
        return 0.0
    if not x.flags.c_contiguous:
        return float(np.einsum(x, list(range(x.ndim)), x, list(range(x.ndim)), []))
    flat = x.reshape(-1)
    return float(np.vdot(flat, flat))


def abs_max(x: np.ndarray) -> float:
    """``max |x|`` (NaN where an entry is NaN), 0 for an empty array."""
    if x.size == 0:
        return 0.0
    return max(float(x.max()), -float(x.min()))


def _exponent(bound: float, limit: float) -> int:
    """The least ``e >= 0`` with ``bound·2^-e <= limit``; 0 where ``bound`` is not finite (a NaN
    or inf input keeps its own result)."""
    if not math.isfinite(bound) or bound <= limit:
        return 0
    return max(0, math.frexp(bound / limit)[1])


def norm_bound(x: np.ndarray, known: float | None = None) -> float:
    """An upper bound of every row's norm ``‖x_i‖`` of ``x (..., T, D)`` (``known`` where the
    caller has one): the Frobenius norm where ``Σx²`` is finite, else ``√D·max|x|`` in
    float64 (NaN where an entry is NaN, inf where one is inf: the max and the min say it)."""
    if known is not None:
        return known
    sq = square_sum(x)
    if math.isfinite(sq):
        return math.sqrt(sq)
    return math.sqrt(x.shape[-1]) * abs_max(x)


def _top(dtype) -> float:
    return float(np.finfo(dtype).max) * HEADROOM


def q_exponent(q, k, scale: float, kn: float | None = None) -> int:
    """``eq``: q is scaled by ``2^-eq`` and the scale by ``2^eq`` (0 where ``scale·2^eq`` would
    not be finite: then the scores could not be either)."""
    kn = norm_bound(k, kn)
    eq = _exponent(norm_bound(q) * kn, _top(q.dtype)) if kn else 0
    return 0 if eq and not math.ldexp(scale, eq) <= float(np.finfo(q.dtype).max) else eq


def v_exponent(v, tk: int, vn: float | None = None) -> int:
    """``ev``: v is scaled by ``2^-ev`` in the forward."""
    return _exponent(TERMS * tk * norm_bound(v, vn), _top(v.dtype))


def dout_exponent(dout, v, dlse, spec: MaskSpec, group: int, vn: float | None = None) -> int:
    """``ed``: dO and dlse are scaled by ``2^-ed`` in the backward. The out a forward returned
    is a weighted average of v's rows (weights summing to 1, or to at most ``1/(1-p)`` with
    dropout), so ``‖O_i‖ <= max‖v_j‖/(1-p)`` bounds delta without a pass over O."""
    dn = norm_bound(dout)
    if not dn:
        return 0
    bound = max(dn * norm_bound(v, vn) / (1 - (spec.dropout_p or 0.0)), spec.tq * group * dn)
    if dlse is not None:
        bound = max(bound, abs_max(dlse))
    return _exponent(bound, _top(dout.dtype))


def scaled(x: np.ndarray, e: int) -> np.ndarray:
    """``x · 2^e`` in x's dtype (x itself where ``e = 0``)."""
    return x if e == 0 else np.ldexp(x, e).astype(x.dtype, copy=False)


def forward(impl, q, k, v, spec: MaskSpec, scale: float, group: int, return_weights: bool,
            norms: tuple = (None, None), **kw):
    """``impl.forward`` with q·k and Σ p v kept inside the dtype (module docstring); ``norms``:
    k's and v's :func:`norm_bound` where the caller has them."""
    eq, ev = q_exponent(q, k, scale, norms[0]), v_exponent(v, spec.tk, norms[1])
    if eq == 0 and ev == 0:
        return impl.forward(q, k, v, spec, scale, group, return_weights, **kw)
    with np.errstate(under="ignore"):
        out, lse, weights = impl.forward(scaled(q, -eq), k, scaled(v, -ev), spec, math.ldexp(scale, eq), group,
                                         return_weights, **kw)
    with np.errstate(over="ignore"):    # an out past the dtype is inf, as the plain arithmetic's
        return scaled(out, ev), lse, weights


def backward(impl, dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int, dlse=None,
             norms: tuple = (None, None), **kw):
    """``impl.backward`` with q·k, dP, delta and dV kept inside the dtype (module docstring)."""
    eq, ed = q_exponent(q, k, scale, norms[0]), dout_exponent(dout, v, dlse, spec, group, norms[1])
    if eq == 0 and ed == 0:
        return impl.backward(dout, q, k, v, out, lse, spec, scale, group, dlse=dlse, **kw)
    dlse = None if dlse is None else scaled(dlse, -ed)
    with np.errstate(under="ignore"):
        dq, dk, dv, *rest = impl.backward(scaled(dout, -ed), scaled(q, -eq), k, v, out, lse, spec,
                                          math.ldexp(scale, eq), group, dlse=dlse, **kw)
    with np.errstate(over="ignore"):    # a gradient past the dtype is inf, as the plain arithmetic's
        return (scaled(dq, ed - eq), scaled(dk, ed), scaled(dv, ed), *rest)
