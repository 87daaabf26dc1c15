"""The gradient of the log decays, as sums that never cancel: shared by the chunked backwards.

In a chunk, ``G_i = g_1 + ... + g_i`` and every decay factor is ``exp(G_a - G_b)`` with
``a >= b``: it depends on the steps ``b < j <= a`` alone, the ones it *crosses*. A term
``x = f · y`` with such a factor adds ``x · dx`` to ``dg_j`` for exactly those ``j``. So

    dg_j = Σ over the terms whose factor crosses j of (term · its upstream gradient)

and every summand carries ``exp(g_j)`` (and the other decays it crosses): at a steep decay
``dg_j`` is tiny because every one of its summands is.

The textbook way to write it is the gradient of each ``G_i`` (``+x·dx`` at ``a``, ``-x·dx``
at ``b``) and then ``dg_j = Σ_{i >= j} dG_i``. That is the same sum in exact arithmetic, but
a factor that crosses nothing (``a = b``: a diagonal term ``q_i·k_i``, or the chunk's last
key ``k_C exp(Γ - G_C)``) enters it twice with opposite signs, each of the size of the
undecayed term (about 1), and their rounding, about ``eps``, stays behind: at ``g = -30``
a step the true ``dg`` is about ``exp(-30) ≈ 1e-13``, so float64 keeps 3 digits and float32
none (measured: 2.7e-3 and 1e6 relative to the largest true entry before this module).

The sums here take each kind of term where it belongs:

* :func:`later`: a factor ``exp(G_i)`` on row i (``Qg_i = q_i ∘ exp(G_i)``, the read of the
  chunk's start state) crosses ``j <= i``: ``Σ_{i >= j}``, a reversed cumulative sum;
* :func:`earlier`: a factor ``exp(Γ - G_s)`` on row s (``Kg_s``, the write into the end
  state) crosses ``j > s``: ``Σ_{s < j}``, a cumulative sum shifted by one (never an
  inclusive sum minus its own term, which would cancel again);
* :func:`crossing`: a pair ``M_is`` (``dA_is · A_is`` of the in-chunk scores, ``s < i``)
  crosses ``s < j <= i``: ``Σ_{i >= j} Σ_{s < j} M_is``, a cumulative sum along the row
  then a masked column sum; the diagonal ``M_ii`` is never read;
* a factor ``exp(Γ)`` (the start state carried to the end) crosses every step: added to all.
"""
from __future__ import annotations

import numpy as np


def later(x: np.ndarray, axis: int = -2) -> np.ndarray:
    """``Σ_{i >= j} x_i`` along ``axis`` (the chunk's rows)."""
    return np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis)


def earlier(x: np.ndarray, axis: int = -2) -> np.ndarray:
    """``Σ_{s < j} x_s`` along ``axis``: 0 at the first row, then the running sum of the rows before."""
    x = np.moveaxis(x, axis, -1)
    out = np.zeros_like(x)
    np.cumsum(x[..., :-1], axis=-1, out=out[..., 1:])
    return np.moveaxis(out, -1, axis)


def crossing(M: np.ndarray) -> np.ndarray:
    """``Σ_{s < j <= i} M_is`` for each j: ``(..., C, C) -> (..., C)``; only the strictly
    lower triangle of M is read (0 at j = 0, where no pair crosses)."""
    C = M.shape[-1]
    out = np.zeros(M.shape[:-1], M.dtype)
    if C < 2:
        return out
    L = np.cumsum(M[..., :-1], axis=-1)                     # L[i, j-1] = Σ_{s < j} M_is   (..., C, C-1)
    below = np.tri(C, C - 1, -1, dtype=bool)                 # rows i >= j for column j-1
    np.sum(L, axis=-2, where=below, out=out[..., 1:])       # Σ_{i >= j} L[i, j-1]
    return out


def to_width(x: np.ndarray, W: int) -> np.ndarray:
    """A per-channel gradient ``(..., Dk)`` summed to the decay's width W (1: a head)."""
    return x if W == x.shape[-1] else x.sum(-1, keepdims=True)
