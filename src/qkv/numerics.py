"""Softmax, log-sum-exp, and merging partial attention results by their lse.

Stability: ``softmax(x) = exp(x - m) / sum(exp(x - m))`` for any ``m``; choosing ``m``
as the row maximum makes every exponent ``<= 0``, so nothing overflows for any finite
input (scores of ±1e4 included) and the largest term is exactly 1, so the sum is >= 1.

-inf entries are "cannot attend": they get weight 0. A row that is entirely -inf (or
empty) has no maximum to subtract; it gets all-zero weights and ``logsumexp = -inf`` (no
NaN, no warning), which is what attention needs for a query that may attend to nothing.

>>> import numpy as np
>>> softmax(np.array([1.0, 0.905, 0.05])).round(4)
array([0.4355, 0.396 , 0.1684])
>>> softmax(np.array([-np.inf, -np.inf]))
array([0., 0.])
>>> float(logsumexp(np.array([1e4, 1e4])))  # 1e4 + log 2, no overflow
10000.69314718056
"""
from __future__ import annotations

import numpy as np

from .errors import ShapeError, as_float_array


def _safe_max(x: np.ndarray, axis: int) -> np.ndarray:
    """Row maximum with -inf rows (and empty ones) mapped to 0, so ``x - m`` stays -inf (not NaN) there."""
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    return np.where(m == -np.inf, 0.0, m).astype(x.dtype, copy=False)


def _check_axis(x: np.ndarray, axis: int) -> int:
    if (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))
            or not -x.ndim <= axis < max(x.ndim, 1)):
        raise ShapeError(f"axis must be an int in [-{x.ndim}, {x.ndim}); got {axis!r}")
    return int(axis)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Row-wise softmax along ``axis``, stable for any finite input; all -inf rows give 0.

    float16 is computed in float32 and returned as float16.
    """
    x = as_float_array("x", x)
    axis = _check_axis(x, axis)
    work = x.astype(np.float32) if x.dtype == np.float16 else x
    e = np.exp(work - _safe_max(work, axis))
    total = np.sum(e, axis=axis, keepdims=True)
    # total is >= 1 wherever the row has a finite entry, and exactly 0 on an all -inf row.
    out = e / np.where(total == 0, 1, total)
    return out.astype(x.dtype, copy=False)


def logsumexp(x, axis: int = -1, keepdims: bool = False) -> np.ndarray:
    """``log(sum(exp(x)))`` along ``axis``, stable; an all -inf row gives -inf."""
    x = as_float_array("x", x)
    axis = _check_axis(x, axis)
    work = x.astype(np.float32) if x.dtype == np.float16 else x
    m = _safe_max(work, axis)
    total = np.sum(np.exp(work - m), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the intended answer
        out = m + np.log(total)
    if not keepdims:
        out = np.squeeze(out, axis=axis)
    return out


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint key sets from their outputs and lse.

    If ``out_a = softmax(s_a) v_a`` with ``lse_a = logsumexp(s_a)`` (and likewise b),
    attention over the union of keys is::

        lse = logaddexp(lse_a, lse_b)
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    Shapes: ``out_* (..., T, Dv)``, ``lse_* (..., T)``. A side with ``lse = -inf`` (saw
    no key) contributes nothing; if both are -inf the row stays ``out = 0, lse = -inf``.
    This is how ring attention and split-key decoding join their pieces.
    """
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(lse == -np.inf, 0.0, lse)
    wa = np.exp(lse_a - safe)[..., None]
    wb = np.exp(lse_b - safe)[..., None]
    return wa * out_a + wb * out_b, lse
