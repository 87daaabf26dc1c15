"""One checked attention problem: q, k, v in the compute dtype, broadcast to their leading
shapes, with the mask spec, the scale and the head grouping (:func:`prepare`), and the sum
that brings a gradient back onto a broadcast input's shape (:func:`sum_to`). Every entry point
starts here: :func:`qkv.attention`, the ring, linear attention, the adapters."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import options as opts
from .errors import OptionError, ShapeError, as_float_array, broadcast_or_raise, expect_ndim, fmt_shape
from .masks import MaskSpec, build_spec


@dataclass
class Problem:
    """One checked attention call: arrays in the compute dtype, broadcast to their leading shapes."""

    q: np.ndarray        # (*L, Tq, D)
    k: np.ndarray        # (*Lk, Tk, D)
    v: np.ndarray        # (*Lk, Tk, Dv)
    spec: MaskSpec
    scale: float
    group: int           # query heads per kv head (1 without gqa)
    in_dtype: np.dtype   # q's dtype: the output's
    shapes: tuple        # the caller's q, k, v shapes, to sum gradients back onto


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 and float32 compute in float32, float64 in float64."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def prepare(q, k, v, *, scale=None, gqa=False, **options) -> Problem:
    """The checked :class:`Problem` of q, k, v, scale, gqa and the mask ``options`` (those of
    :func:`qkv.masks.build_spec`): what every entry point (the ring, linear attention, the
    adapters) starts from."""
    q, k, v = as_float_array("q", q), as_float_array("k", k), as_float_array("v", v)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ShapeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
    layout = "(..., Hq, Tq, D)" if gqa else "(..., Tq, D)"
    expect_ndim("q", q, 3 if gqa else 2, layout)
    expect_ndim("k", k, 3 if gqa else 2, layout.replace("Hq", "Hkv").replace("Tq", "Tk"))
    expect_ndim("v", v, 3 if gqa else 2, layout.replace("Hq", "Hkv").replace("Tq", "Tk").replace("D)", "Dv)"))
    tq, d = q.shape[-2:]
    tk = k.shape[-2]
    if k.shape[-1] != d:
        raise ShapeError(
            f"k must have the feature size D of q: shape (..., Tk, D) = (..., {tk}, {d}); "
            f"got {fmt_shape(k.shape)}"
        )
    if v.shape[:-1] != k.shape[:-1]:
        raise ShapeError(
            f"v must have shape (..., Tk, Dv) with k's leading axes and Tk = {fmt_shape(k.shape[:-1])} + (Dv,); "
            f"got {fmt_shape(v.shape)}"
        )
    if tq == 0 or tk == 0 or d == 0 or v.shape[-1] == 0:
        raise ShapeError(
            f"q, k and v must have Tq, Tk, D and Dv >= 1; got q {fmt_shape(q.shape)}, "
            f"k {fmt_shape(k.shape)}, v {fmt_shape(v.shape)} (use kv_lengths=0 for an empty key set)"
        )
    opts.parse_flag("gqa", gqa)

    if gqa:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv == 0 or hq % hkv != 0:
            raise ShapeError(
                f"with gqa=True the query heads Hq must be a multiple of the kv heads Hkv >= 1; "
                f"got Hq = {hq} (q {fmt_shape(q.shape)}) and Hkv = {hkv} (k {fmt_shape(k.shape)})"
            )
        batch = broadcast_or_raise("the batch axes of q and k (before the head axis)",
                                   {"q": q.shape[:-3], "k": k.shape[:-3]})
        lead, lead_kv, group = batch + (hq,), batch + (hkv,), hq // hkv
    else:
        try:
            lead = q.shape[:-2]
            if k.shape[:-2] != lead:
                lead = tuple(np.broadcast_shapes(lead, k.shape[:-2]))
        except ValueError:
            hint = ""
            if q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] % k.shape[-3] == 0:
                hint = " (for grouped-query heads pass gqa=True)"
            raise ShapeError(
                f"the leading axes of q (..., Tq, D) and k (..., Tk, D) must broadcast; "
                f"got q {fmt_shape(q.shape)} and k {fmt_shape(k.shape)}{hint}"
            ) from None
        lead_kv, group = lead, 1

    scale = opts.parse_scale(scale)
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    in_dtype, cdt = q.dtype, _compute_dtype(q.dtype)
    if abs(scale) > float(np.finfo(cdt).max):
        raise OptionError(f"scale must fit the compute dtype {cdt} (|scale| <= {np.finfo(cdt).max:.4g}); "
                         f"got {scale!r}")
    spec = build_spec(lead, tq, tk, dtype=cdt, **options)
    shapes = (q.shape, k.shape, v.shape)
    q = _as(q, cdt, lead + (tq, d))
    k = _as(k, cdt, lead_kv + (tk, d))
    v = _as(v, cdt, lead_kv + (tk, v.shape[-1]))
    return Problem(q, k, v, spec, float(scale), group, in_dtype, shapes)


def _as(x: np.ndarray, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """``x`` in ``dtype``, broadcast to ``shape`` (a read-only view); ``x`` itself when it is both."""
    if x.dtype != dtype:
        x = x.astype(dtype)
    return x if x.shape == shape else np.broadcast_to(x, shape)


def sum_to(x: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a gradient over the axes that broadcasting added or stretched, back to ``shape``."""
    extra = x.ndim - len(shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if stretched:
        x = x.sum(axis=stretched, keepdims=True)
    return x
