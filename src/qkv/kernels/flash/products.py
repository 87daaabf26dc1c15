"""A score tile's two products, ``S = Q Kᵀ`` and ``acc += P V``, chosen by the task's rows.

A task of many rows takes BLAS's matrix products on a 512 × 1024 tile. Decoding rows (at
most ``Tiles.thin_rows``: one new token a head, a few stacked query heads of a kv head)
make a thin product that BLAS runs badly, so they read K and V once each: float32 with the
``fast`` extra by the compiled passes of :mod:`.compiled` (every row's dot products from L1),
else by BLAS's matrix-vector products over L2-sized key chunks (``Tiles.gemv_keys``).

Both functions of a pair take the keys ``a:b``: ``scores(kk, qs, a, b, tiles)`` returns the
tile transposed, ``(w, R)`` (a view of a per-thread scratch buffer), and
``values(st, vv, a, b, acc, tiles)`` adds ``stᵀ V`` into ``acc (R, Dv)``.
"""
from __future__ import annotations

import numpy as np

from ... import jit
from .tiles import Tiles, scratch


def choose(dt, nrow: int, tiles: Tiles) -> tuple:
    """``(scores, values)`` for a task of ``nrow`` stacked rows in the compute dtype ``dt``."""
    if nrow > tiles.thin_rows:
        return scores_gemm, values_gemm
    if dt == np.float32 and jit.flash() is not None:
        return scores_compiled, values_compiled
    return scores_gemv, values_gemv


def scores_gemm(kk, qs, a, b, tiles) -> np.ndarray:
    st = scratch(qs.shape[0] * (b - a), qs.dtype, tiles).reshape(b - a, qs.shape[0])  # the tile, transposed
    np.matmul(kk[a:b], qs.T, out=st)                         # (w,D) @ (D,R) -> (w,R)
    return st


def values_gemm(st, vv, a, b, acc, tiles) -> None:
    acc += st.T @ vv[a:b]                                    # (R,w) @ (w,Dv) -> (R,Dv)


def scores_gemv(kk, qs, a, b, tiles) -> np.ndarray:
    """R matrix-vector products per L2-sized key chunk: they beat one thin GEMM."""
    s3 = scratch(qs.shape[0] * (b - a), qs.dtype, tiles).reshape(qs.shape[0], b - a, 1)
    for c in range(a, b, tiles.gemv_keys):
        e = min(c + tiles.gemv_keys, b)
        np.matmul(kk[c:e], qs[:, :, None], out=s3[:, c - a:e - a])  # (w,D) @ (R,D,1) -> (R,w,1)
    return s3[:, :, 0].T


def values_gemv(st, vv, a, b, acc, tiles) -> None:
    """By L2-sized chunks of V too: OpenBLAS takes (R,1024) @ (1024,Dv) at twice the rate."""
    for c in range(a, b, tiles.gemv_keys):
        e = min(c + tiles.gemv_keys, b)
        acc += st[c - a:e - a].T @ vv[c:e]                   # (R,w) @ (w,Dv) -> (R,Dv)


def scores_compiled(kk, qs, a, b, tiles) -> np.ndarray:
    """K read once, every row's dot products from L1 (float32)."""
    s2 = scratch(qs.shape[0] * (b - a), qs.dtype, tiles).reshape(qs.shape[0], b - a)
    jit.flash().thin_scores(kk[a:b], qs, s2)                 # (R,D) @ (D,w) -> (R,w)
    return s2.T


def values_compiled(st, vv, a, b, acc, tiles) -> None:
    """V read once (float32)."""
    jit.flash().thin_values(st.T, vv[a:b], acc)              # (R,w) @ (w,Dv) -> (R,Dv)
