"""numba passes of the row kernel (:mod:`qkv.kernels.rows.kernel`); load it through ``qkv.jit.load(qkv.jit.ROWS)`` only.

Two passes over a stack of score rows ``(n, Tq, Tk)`` float32, each one loop over memory
where NumPy takes five or six with a temporary each, inlined into :mod:`.fused`'s loop
over heads. Row ``i`` may see the keys
``[lo[i], hi[i])`` (one contiguous run: causal, window, chunk, any alignment); every other
entry is written 0. The exponential is :func:`~qkv.kernels.flash.compiled.pow2` of scores
taken to log2 units (``s · scale · log2 e``) inside its loop, inlined so that LLVM vectorises it.

- :func:`forward_pass`: raw products ``q·k`` in, probabilities ``P`` out, and ``lse``.
- :func:`backward_pass`: raw products and ``dP = dO Vᵀ`` in; ``P`` recomputed from the
  row's own max and sum (self-normalised: it never reads the saved lse) and
  ``dS = scale · P ∘ (dP − Σ_j P_ij dP_ij + dlse_i)`` out, in place of ``dP``.

Both take :mod:`qkv.score_ops`' softcap (``s = c·tanh(x/c)`` before the exponential, its
slope ``1 - tanh²`` on dS; :func:`~qkv.kernels.flash.compiled.tanh32`, its first branch alone on a row within it) and dropout (``P ∘ Z``
after the softmax, ``Z ∘ dO Vᵀ`` in the backward, the keep-mask drawn again from the rows'
keys and the columns by :func:`~qkv.kernels.flash.compiled.keep_bits`). Each of the four
cases runs its own loops (the flags are constants of the kernel the pass is inlined into), so
each vectorises, and a job compiles only the cases it calls.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ..flash.compiled import TSPLIT, FASTMATH, abs_max, keep_bits, pow2, tanh_any

f32 = np.float32
u32 = np.uint32
LOG2E = 1.0 / math.log(2.0)
LN2 = f32(math.log(2.0))
LOG2E32 = f32(LOG2E)
NEG_INF = f32(-np.inf)
TINY, HUGE = f32(2.0 ** -60), f32(2.0 ** 100)   # a row's Σ 2^x without its max, to stay exact


@numba.njit(inline="always", fastmath=FASTMATH)
def _zero(x):
    for j in range(x.shape[0]):
        x[j] = 0.0


@numba.njit(inline="always", fastmath=FASTMATH)
def _exp2_sum(x, c, m, e):
    """e[:n] = 2^(c·x - m) (the scaling in the same loop); returns the sum, added in a loop of
    its own that only reads: see :func:`_sum`."""
    n = x.shape[0]
    for j in range(n):
        e[j] = pow2(x[j] * c - m)
    return _sum(e[:n])


@numba.njit(inline="always", fastmath=FASTMATH)
def _sum(e):
    """Σ e[j] in the vector order LLVM gives a loop of ``e.shape[0]`` entries: a function of
    the length alone.

    Never add into a scalar in a loop that also stores to another array: LLVM then compiles
    the loop twice, vector and scalar, and picks one at run time by how far apart the arrays
    lie (``e - x < 256`` bytes: scalar, for fear of overlap). The two versions add in other
    orders, so the sum's bits depended on where the heap put a scratch row: what earlier
    calls left in a thread's arena (a head after other shapes' calls got other bits than
    alone, a fresh numba thread's arena other bits than the main thread's)."""
    l = f32(0.0)
    for j in range(e.shape[0]):
        l += e[j]
    return l


@numba.njit(fastmath=FASTMATH, cache=True)
def _max(x, c):
    """max(c·x) of a non-empty 1-D array, NaN if any is (a scalar loop: the rare rows only)."""
    m = x[0] * c
    for j in range(x.shape[0]):
        y = x[j] * c
        if not y <= m:
            m = y
            if m != m:
                return m
    return m


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _capped(x, cap_in, cap_out, slope, want_slope):
    """Raw products to softcapped scores in place, ``cap_out·tanh(cap_in·x)`` (``cap_in =
    scale / cap``, ``cap_out = cap``), and ``slope = 1 - tanh²`` where wanted (a constant of
    each caller). Uncapped rows are scaled inside the exponential's loop."""
    if abs_max(x) * abs(cap_in) < TSPLIT:        # the row never reaches tanh's second branch (flash.compiled.all_small)
        _capped_loop(x, cap_in, cap_out, slope, want_slope, True)
    else:
        _capped_loop(x, cap_in, cap_out, slope, want_slope, False)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _capped_loop(x, cap_in, cap_out, slope, want_slope, small):
    for j in range(x.shape[0]):
        t = tanh_any(x[j] * cap_in, small)
        x[j] = cap_out * t
        if want_slope:
            slope[j] = f32(1.0) - t * t


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _probabilities(row, j0, j1, a, c, e):
    """row[j0:j1] (raw products: the scores are ``a·row[j]``, ``c = a·log2 e`` rounded once) =
    their softmax, 0 elsewhere; returns the lse, ln Σ_j exp(a·row[j]). ``e`` is a scratch row
    of at least j1 - j0 entries.

    Most rows take two vector passes and no max: while the sum of ``2^(c·x)`` lies in
    ``[2^-60, 2^100]`` every term is exact to float32's rounding (none overflows, none that
    matters underflows: pow2 is relatively accurate over its whole range). Other rows
    (large scores, a NaN) subtract the row's max first, as the reference does, from the
    scores stored first (:func:`_scaled_max`): the max entry's difference is then exactly 0
    and its term exactly 1, so the sum is at least 1 whatever the magnitude. (Subtracting the
    max of ``c·x`` inside the exponential's loop instead let LLVM contract ``c·x - m`` into one
    fused multiply-add, which skips the product's rounding: at scores of 4e9 the max entry's
    term came out 2^-256 = 0, the sum 0, the row NaN.)
    (Loops over slices from 0: an index numba knows is not negative keeps LLVM's vector loops.)"""
    _zero(row[:j0])
    _zero(row[j1:])
    x = row[j0:j1]
    return _normalised(x, e, _exp2_sum(x, c, f32(0.0), e), a)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _normalised(x, e, l, a):
    """x = e / l, from a row's terms ``e = 2^(c·x)`` and their sum ``l``, or, where ``l`` left
    [2^-60, 2^100], from its terms taken again below its max (:func:`_probabilities`); returns
    the row's lse."""
    m = f32(0.0)
    if not (l >= TINY and l <= HUGE):
        m = _scaled_max(x, a)
        l = _exp2_below(x, m, e)
    inv = f32(1.0) / l
    for j in range(x.shape[0]):
        x[j] = e[j] * inv
    return m + np.log2(l) * LN2


@numba.njit(inline="always")
def _same_keys(lo, hi, i):
    """Rows i to i+3 see the same keys (full attention; a window's rows do not)."""
    return lo[i + 3] == lo[i] and hi[i + 3] == hi[i] and lo[i + 1] == lo[i] and hi[i + 1] == hi[i] and \
        lo[i + 2] == lo[i] and hi[i + 2] == hi[i]


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _probabilities4(s, i, j0, j1, a, c, e4, lse):
    """Rows i to i+3 of ``s (Tq, Tk)``, each seeing keys j0:j1: each row as :func:`_probabilities`
    makes it (the same bits: every term its own ``pow2``, each sum :func:`_sum` over its own
    scratch row of the same length), their exponentials in one loop: four chains of pow2's
    products in flight, where one row a loop waited on their latency (exponential, sum and
    division at 64-256 keys: 1.2-1.45x faster, Zen 3). Writes lse[i:i+4]."""
    n = j1 - j0
    x0, x1, x2, x3 = s[i][j0:j1], s[i + 1][j0:j1], s[i + 2][j0:j1], s[i + 3][j0:j1]
    e0, e1, e2, e3 = e4[0][:n], e4[1][:n], e4[2][:n], e4[3][:n]
    m = f32(0.0)
    for j in range(n):
        e0[j] = pow2(x0[j] * c - m)
        e1[j] = pow2(x1[j] * c - m)
        e2[j] = pow2(x2[j] * c - m)
        e3[j] = pow2(x3[j] * c - m)
    for k in range(4):
        row = s[i + k]
        _zero(row[:j0])
        _zero(row[j1:])
        ek = e4[k][:n]
        lse[i + k] = _normalised(row[j0:j1], ek, _sum(ek), a)


@numba.njit(inline="always", fastmath=FASTMATH)
def _scaled_max(x, a):
    """x = a·x in place (the scores, in natural units: finite wherever float32 holds them);
    returns their max, NaN if any is."""
    for j in range(x.shape[0]):
        x[j] *= a
    return _max(x, f32(1.0))


@numba.njit(inline="always", fastmath=FASTMATH)
def _exp2_below(x, m, e):
    """e[:n] = exp(x - m) = 2^((x - m)·log2 e) of stored scores ``x`` and their max ``m``;
    returns the sum, at least 1 (the max's term: ``x - m = 0``), added in a loop of its own
    (:func:`_sum`)."""
    n = x.shape[0]
    for j in range(n):
        e[j] = pow2((x[j] - m) * LOG2E32)
    return _sum(e[:n])


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def _keep(z, klo, khi, col0, thresh, zscale):
    """z[j] = keep / (1 - p) of columns col0 + j of one row (qkv.score_ops' mask)."""
    for j in range(z.shape[0]):
        z[j] = zscale if keep_bits(klo, khi, col0 + j) >= thresh else f32(0.0)


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def forward_pass(s, lo, hi, c, sc, cap_in, cap_out, lse, klo, khi, col0, thresh, zscale, capped, drop):
    """s (n, Tq, Tk) raw products -> P (times the keep-mask Z where ``drop``) in place;
    lse (n, Tq) = ln Σ_j exp(sc·s_ij) = ln Σ_j 2^(c·s_ij) (``sc`` the scale, ``c = scale·log2 e``;
    softcapped, ``cap_out·tanh(cap_in·s)``, where ``capped``). ``klo``/``khi`` (n, Tq) uint32:
    the rows' dropout keys; ``col0``: the first key's column. ``capped`` and ``drop`` are
    compile-time constants of the caller (:mod:`.fused` compiles one kernel per case), so
    each case is its own loops and only the case called is compiled."""
    n, tq, tk = s.shape
    e = np.empty(tk, f32)
    e4 = np.empty((4, tk), f32)
    z = np.empty(tk, f32)
    for h in range(n):
        i = 0
        while i < tq:
            j0, j1 = lo[i], hi[i]
            four = not capped and j0 < j1 and i + 4 <= tq and _same_keys(lo, hi, i)
            if four:                         # four rows that see the same keys: their exponentials in one loop
                _probabilities4(s[h], i, j0, j1, sc, c, e4, lse[h])
            else:
                row = s[h, i]
                if j0 >= j1:                 # a row that sees nothing: P = 0, lse = -inf
                    _zero(row)
                    lse[h, i] = NEG_INF
                    i += 1
                    continue
                if capped:
                    _capped(row[j0:j1], cap_in, cap_out, e, False)
                lse[h, i] = _probabilities(row, j0, j1, f32(1.0) if capped else sc, LOG2E32 if capped else c, e)
            if drop:                         # P ∘ Z; lse stays the undropped one
                for r in range(i, i + 4 if four else i + 1):
                    x = s[h, r][j0:j1]
                    zz = z[:j1 - j0]
                    _keep(zz, klo[h, r], khi[h, r], u32(col0 + j0), thresh, zscale)
                    for j in range(x.shape[0]):
                        x[j] *= zz[j]
            i += 4 if four else 1


@numba.njit(inline="always", fastmath=FASTMATH, error_model="numpy")
def backward_pass(s, dp, lo, hi, c, cap_in, cap_out, sc, dlse, use_dlse, klo, khi, col0, thresh, zscale,
                  capped, drop):
    """s (n, Tq, Tk) raw products -> P ∘ Z in place (for dV); dp (n, Tq, Tk) = dO Vᵀ -> dS
    (times ``sc``, the scale, and the softcap's slope) in place; ``dlse`` (n, Tq) read where
    ``use_dlse``. Arguments as :func:`forward_pass` (``capped``, ``drop`` constants of the caller)."""
    n, tq, tk = s.shape
    e = np.empty(tk, f32)
    slope = np.empty(tk, f32)
    z = np.empty(tk, f32)
    for h in range(n):
        for i in range(tq):
            j0, j1 = lo[i], hi[i]
            row, g = s[h, i], dp[h, i]
            if j0 >= j1:
                _zero(row)
                _zero(g)
                continue
            p, gs = row[j0:j1], g[j0:j1]
            sl = slope[:j1 - j0]
            if capped:
                _capped(p, cap_in, cap_out, sl, True)
            _probabilities(row, j0, j1, f32(1.0) if capped else sc, LOG2E32 if capped else c, e)
            zz = z[:j1 - j0]
            if drop:                         # ∂L/∂P = Z ∘ dO Vᵀ
                _keep(zz, klo[h, i], khi[h, i], u32(col0 + j0), thresh, zscale)
                for j in range(p.shape[0]):
                    gs[j] *= zz[j]
            delta = f32(0.0)
            for j in range(p.shape[0]):
                delta += p[j] * gs[j]
            if use_dlse:
                delta -= dlse[h, i]
            _zero(g[:j0])
            _zero(g[j1:])
            for j in range(p.shape[0]):
                d = p[j] * (gs[j] - delta) * sc
                if capped:                   # through the softcap: dX = dS ∘ (1 - tanh²)
                    d *= sl[j]
                gs[j] = d
            if drop:                         # P ∘ Z, for dV = (P ∘ Z)ᵀ dO
                for j in range(p.shape[0]):
                    p[j] *= zz[j]
