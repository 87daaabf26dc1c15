"""numba passes of the row kernel (:mod:`qkv.kernels.rows`); load it through ``qkv.jit.load(qkv.jit.ROWS)`` only.

Two passes over a stack of score rows ``(n, Tq, Tk)`` float32, each one loop over memory
where NumPy takes five or six with a temporary each. Row ``i`` may see the keys
``[lo[i], hi[i])`` (one contiguous run: causal, window, chunk, any alignment); every other
entry is written 0. The exponential is :func:`~qkv.kernels.flash.compiled.pow2` of scores
carried in log2 units (``s · scale · log2 e``), inlined so that LLVM vectorises it.

- :func:`softmax_rows`: raw products ``q·k`` in, probabilities ``P`` out, and ``lse``.
- :func:`softmax_grad_rows`: raw products and ``dP = dO Vᵀ`` in; ``P`` recomputed from the
  row's own max and sum (self-normalised: it never reads the saved lse) and
  ``dS = scale · P ∘ (dP − Σ_j P_ij dP_ij + dlse_i)`` out, in place of ``dP``.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from .flash.compiled import FASTMATH, pow2

f32 = np.float32
LOG2E = 1.0 / math.log(2.0)
LN2 = f32(math.log(2.0))
NEG_INF = f32(-np.inf)
TINY, HUGE = f32(2.0 ** -60), f32(2.0 ** 100)   # a row's Σ 2^x without its max, to stay exact


@numba.njit(inline="always", fastmath=FASTMATH)
def _zero(x):
    for j in range(x.shape[0]):
        x[j] = 0.0


@numba.njit(inline="always", fastmath=FASTMATH)
def _exp2_sum(x, m, e):
    """e[:n] = 2^(x - m); returns the sum."""
    l = f32(0.0)
    for j in range(x.shape[0]):
        t = pow2(x[j] - m)
        e[j] = t
        l += e[j]
    return l


@numba.njit(fastmath=FASTMATH, cache=True)
def _max(x):
    """max(x) of a non-empty 1-D array, NaN if any is (a scalar loop: the rare rows only)."""
    m = x[0]
    for j in range(x.shape[0]):
        if not x[j] <= m:
            m = x[j]
            if m != m:
                return m
    return m


@numba.njit(inline="always", fastmath=FASTMATH)
def _probabilities(row, j0, j1, c, e):
    """row[j0:j1] = softmax(c · row[j0:j1]) (base 2), 0 elsewhere; returns log2 Σ_j 2^(c·row[j]).
    ``e`` is a scratch row of at least j1 - j0 entries.

    Most rows take two vector passes and no max: while the sum of ``2^x`` lies in
    ``[2^-60, 2^100]`` every term is exact to float32's rounding (none overflows, none that
    matters underflows: pow2 is relatively accurate over its whole range). Other rows
    (large scores, a NaN) subtract the row's max first, as the reference does.
    (Loops over slices from 0: an index numba knows is not negative keeps LLVM's vector loops.)"""
    _zero(row[:j0])
    _zero(row[j1:])
    x = row[j0:j1]
    for j in range(x.shape[0]):
        x[j] *= c
    m = f32(0.0)
    l = _exp2_sum(x, m, e)
    if not (l >= TINY and l <= HUGE):
        m = _max(x)
        l = _exp2_sum(x, m, e)
    inv = f32(1.0) / l
    for j in range(x.shape[0]):
        x[j] = e[j] * inv
    return m + np.log2(l)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def softmax_rows(s, lo, hi, scale, lse):
    """s (n, Tq, Tk) raw products -> P in place; lse (n, Tq) = log Σ_j exp(scale · s_ij)."""
    n, tq, tk = s.shape
    c = f32(scale * LOG2E)
    e = np.empty(tk, f32)
    for h in range(n):
        for i in range(tq):
            j0, j1 = lo[i], hi[i]
            row = s[h, i]
            if j0 >= j1:                     # a row that sees nothing: P = 0, lse = -inf
                _zero(row)
                lse[h, i] = NEG_INF
                continue
            lse[h, i] = _probabilities(row, j0, j1, c, e) * LN2


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH, error_model="numpy")
def softmax_grad_rows(s, dp, lo, hi, scale, dlse, use_dlse):
    """s (n, Tq, Tk) raw products -> P in place; dp (n, Tq, Tk) = dO Vᵀ -> dS (scaled) in place."""
    n, tq, tk = s.shape
    c = f32(scale * LOG2E)
    sc = f32(scale)
    e = np.empty(tk, f32)
    for h in range(n):
        for i in range(tq):
            j0, j1 = lo[i], hi[i]
            row, g = s[h, i], dp[h, i]
            if j0 >= j1:
                _zero(row)
                _zero(g)
                continue
            _probabilities(row, j0, j1, c, e)
            p, gs = row[j0:j1], g[j0:j1]
            delta = f32(0.0)
            for j in range(p.shape[0]):
                delta += p[j] * gs[j]
            if use_dlse:
                delta -= dlse[h, i]
            _zero(g[:j0])
            _zero(g[j1:])
            for j in range(p.shape[0]):
                gs[j] = p[j] * (gs[j] - delta) * sc
