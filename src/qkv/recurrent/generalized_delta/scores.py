"""The masked, decayed products inside a chunk of the dplr recurrence (:mod:`qkv.recurrent.generalized_delta.chunk`).

Two row kinds ``x`` (the queries ``q`` read the state after step t; the removal keys ``a``
read it before step t's decay) against two column kinds ``y`` (the keys ``k`` and the
in-context keys ``b``), in one chunk of C steps::

    A[x, y, t, s] = Σ_i x_t[i] y_s[i] exp(Gx_t[i] - G_s[i])      s <= t (x = q), s < t (x = a)

with ``G`` the chunk's running sum of the log decays (``G_t = g_1 + ... + g_t``, so
``G_t - G_s`` is the decay from step s to step t) and ``Gx = G`` for q, ``Gx_t = G_{t-1}``
for a. Every kept exponent is ``<= 0``: the entries are bounded however strong the decay.

**Per-channel decays** (``G (…, C, Dk)``). Writing the sum as one matrix product needs
``exp(Gx_t - G_s) = exp(Gx_t - G_r) · exp(G_r - G_s)``, and ``exp(-G_s)`` alone overflows
(a decay of ``exp(-30)`` a step passes float32's range in three steps). Here every product
is split at a *reference point* ``r`` between its rows and its columns: the rows ``t`` after
``r`` and the columns ``s`` at or before it, so both factors are ``<= 1``::

    A[t >= m, s < m] = (x_t ∘ exp(Gx_t - G_{m-1})) · (y_s ∘ exp(G_{m-1} - G_s))   one matmul

(``Gx_t <= G_{m-1}`` for ``t >= m``, for both row kinds; ``G_{m-1} <= G_s`` for ``s < m``).
A factor underflows only where the product it belongs to is below the smallest float:
the error is absolute and that small. The chunk's lower triangle is cut in two at its
middle ``m``, the lower-left block is that one product, and the two diagonal halves are cut
again, down to blocks of at most :data:`LEAF` steps, where the exact ``(c, c, Dk)``
elementwise form is used. The factors are running products of the steps' decays
``e = exp(g)`` (each ``<= 1``), not exponentials of differences of running sums: no
exponential beyond ``e`` and no cancellation. Work: ``C·Dk·log(C)`` multiplications for the
factors, ``C·LEAF·Dk`` for the leaves, the rest ``C²·Dk`` in BLAS.

**One decay a head** (``g (…, C)``): ``A = (x yᵀ) ∘ D``, ``D[t, s] = exp(Gx_t - G_s)`` on
the mask. The exponent is the segment sum ``g_{s+1} + ... + g_{tx}`` (``tx = t`` for q,
``t - 1`` for a) summed from the steps themselves (:func:`head_decays`, a product with a
0/1 triangle in float64), never a difference of running sums ``G_t - G_s``: those lose the
small steps behind a huge one (``-1e20 + (-0.5) == -1e20`` in float64, and the difference
is then 0 where it should be -0.5). Every segment sum is a sum of at most C terms ``<= 0``:
within C ulps of itself, and ``<= 0`` without a clamp. One matmul and one ``(C, C)`` exp a chunk.

**Backward.** Given ``dA`` (zero above the masks), ``dx_t = Σ_s dA[t,s] y_s ∘ exp(Gx_t - G_s)``
and ``dy_s = Σ_t dA[t,s] x_t ∘ exp(Gx_t - G_s)``, through the same split (the transposed
products) or the same leaves.

*The decays' gradient.* The pair ``(t, s)`` contributes the term
``T[t, s, i] = dA[t,s] x_t[i] y_s[i] exp(Gx_t[i] - G_s[i])`` to ``dg_j[i]`` for each step
it crosses, ``s < j <= tx``::

    dg_j = Σ_{s < j <= tx} T[t, s]                                                    (3)

Written as ``Σ_{t >= j} x ∘ dx - Σ_{s >= j} y ∘ dy`` (the pairs with both ``tx`` and ``s``
at or after ``j``, the diagonal's among them, are in both sums and cancel) it is a
difference of O(1) sums whose exact value is ``O(exp(g_j))``: at ``g = -30`` float64's rounding of the O(1) sums is then 1e-3
of the answer. So (3) is summed as it stands, every term crossing ``j``:

- a cut ``(lo, mid, hi)``: every row ``tx >= mid - 1``, every column ``s < mid``. For
  ``j < mid`` its pairs crossing ``j`` are its columns ``s < j``, all rows: an exclusive
  running sum of the block's column sums ``y ∘ dy_block``; for ``j >= mid``, its rows
  ``tx >= j``, all columns: a reverse running sum of the block's row sums ``x ∘ dx_block``
  (an a row counted one step earlier). Each such row or column sum is a sum of terms that
  all cross ``j``.
- a leaf: the ``(c, c, Dk)`` terms themselves, summed over the pairs crossing each ``j``
  (a product with a constant 0/1 ``(2c², c)`` mask).
- one decay a head: ``T = dA ∘ A`` summed over the kinds (``(C, C)``), then exclusive
  running sums along each row (``Σ_{s < j} T[t, s]``: all crossing ``j`` where ``j <= tx``)
  summed over the rows ``tx >= j``.

Running sums are products with 0/1 triangles (``np.cumsum`` along these short axes is an
order of magnitude slower): the same terms, summed in another order.

Layout: ``X (…, 2, C, Dk)`` = [q, a], ``Y (…, 2, C, Dk)`` = [k, b]; one decay a head:
``D (…, 2, C, C)``; a decay a channel: ``e (…, C, Dk)``;
``A (…, 2, 2, C, C)`` = [[qk, qb], [ak, ab]].
"""
from __future__ import annotations

import functools

import numpy as np

LEAF = 4    # steps of the diagonal blocks computed elementwise (measured: 4 beat 8 and 16)


def _masks(c: int) -> np.ndarray:
    """``(2, c, c)``: s <= t for the q rows, s < t for the a rows."""
    return np.stack([np.tri(c, dtype=bool), np.tri(c, k=-1, dtype=bool)])


def running_product(x: np.ndarray, reverse: bool = False) -> np.ndarray:
    """Inclusive running products along axis -2 (from the end when ``reverse``), by doubling:
    ``log2(n)`` multiplications of shifted slices (``np.cumprod`` along an inner axis is an
    order of magnitude slower here)."""
    out = x[..., ::-1, :].copy() if reverse else x.copy()
    shift = 1
    while shift < out.shape[-2]:
        out[..., shift:, :] = out[..., shift:, :] * out[..., :-shift, :]   # the right side is read first
        shift *= 2
    return out[..., ::-1, :] if reverse else out


def running_sum(x: np.ndarray, reverse: bool = False, exclusive: bool = False) -> np.ndarray:
    """Running sums along axis -2: ``Σ_{r <= t} x_r`` (``r < t`` when ``exclusive``; ``r >= t``,
    ``r > t`` when ``reverse``), as a product with a 0/1 triangle: each output the sum of
    exactly its terms."""
    m = x.shape[-2]
    tri = np.tri(m, k=-1 if exclusive else 0, dtype=x.dtype)
    return (tri.T if reverse else tri) @ x                              # (m,m) @ (…,m,D) -> (…,m,D)


def head_decays(g: np.ndarray, dtype) -> np.ndarray:
    """``D (…, 2, C, C)`` in ``dtype`` from one decay a head ``g (…, C)``: ``D[0, t, s] =
    exp(g_{s+1} + ... + g_t)`` for ``s <= t``, ``D[1, t, s] = D[0, t-1, s]`` for ``s < t``, 0
    above the masks. The segment sums are summed from the steps (in float64), never
    differenced from running sums."""
    C = g.shape[-1]
    g = np.maximum(g.astype(np.float64), -1000.0)   # exp(-1000) is 0 already; two of -1.8e308 would sum to -inf
    later = np.where(np.tri(C, k=-1, dtype=bool), g[..., :, None], 0)       # [r, s] = g_r, r > s
    seg = np.tri(C) @ later                                  # (C,C) @ (…,C,C): [t, s] = Σ_{s < r <= t} g_r
    D = np.zeros(g.shape[:-1] + (2, C, C), dtype)
    np.multiply(np.exp(seg), np.tri(C), out=D[..., 0, :, :], casting="unsafe")
    D[..., 1, 1:, :] = D[..., 0, :-1, :]
    return D


def _leaf_decays(e, lo, hi):
    """``E (…, 2, c, c, Dk) = exp(Gx_t - G_s)`` on the masks, 0 above, as products of the
    steps' decays ``e_t = exp(g_t) <= 1`` (row t = row t-1 times ``e_t``); the a rows are
    the q rows one step later (``Gx_t = G_{t-1}``)."""
    c = hi - lo
    E = np.zeros(e.shape[:-2] + (2, c, c, e.shape[-1]), e.dtype)
    Eq = E[..., 0, :, :, :]
    Eq[..., 0, 0, :] = 1
    for t in range(1, c):
        np.multiply(Eq[..., t - 1, :t, :], e[..., lo + t, None, :], out=Eq[..., t, :t, :])
        Eq[..., t, t, :] = 1
    E[..., 1, 1:, :, :] = Eq[..., :-1, :, :]
    return E


def _split(X, Y, e, lo, mid, hi):
    """The rows ``mid:hi`` and columns ``lo:mid`` scaled to the reference ``G_{mid-1}``:
    ``(Xs (…, 2·m2, Dk), fq, Ys (…, 2·m1, Dk), fy)`` with the factors (<= 1)
    ``fq_t = exp(G_t - G_{mid-1}) = e_mid ⋯ e_t`` of the q rows and
    ``fy_s = exp(G_{mid-1} - G_s) = e_{s+1} ⋯ e_{mid-1}`` of the columns, running products
    of the steps' decays (no exponential, no cancellation); an a row's factor is the q row's
    one step earlier (``Gx_t = G_{t-1}``), 1 on the first row."""
    fq = running_product(e[..., mid:hi, :])                                 # (…,m2,Dk)
    fy = np.ones(e.shape[:-2] + (mid - lo, e.shape[-1]), e.dtype)          # (…,m1,Dk)
    fy[..., :-1, :] = running_product(e[..., lo + 1:mid, :], reverse=True)
    fy = fy[..., None, :, :]
    Xs = _scale_rows(X[..., mid:hi, :], fq)
    Ys = Y[..., lo:mid, :] * fy
    return Xs.reshape(X.shape[:-3] + (-1, X.shape[-1])), fq, Ys.reshape(Y.shape[:-3] + (-1, Y.shape[-1])), fy


def _scale_rows(Z, fq):
    """``Z (…, 2, m, Dk)`` times the row factors: ``fq`` for the q rows, ``fq`` one step
    earlier for the a rows (their first row is not scaled)."""
    out = np.empty_like(Z)
    np.multiply(Z[..., 0, :, :], fq, out=out[..., 0, :, :])
    out[..., 1, 0, :] = Z[..., 1, 0, :]
    np.multiply(Z[..., 1, 1:, :], fq[..., :-1, :], out=out[..., 1, 1:, :])
    return out


def _blocks(C: int):
    """The recursion's cuts ``(lo, mid, hi)`` and leaves ``(lo, hi)`` of ``[0, C)``."""
    cuts, leaves, todo = [], [], [(0, C)]
    while todo:
        lo, hi = todo.pop()
        if hi - lo <= LEAF:
            leaves.append((lo, hi))
            continue
        mid = (lo + hi) // 2
        cuts.append((lo, mid, hi))
        todo += [(lo, mid), (mid, hi)]
    return cuts, leaves


def _pairs(P, m2, m1):
    """``(…, 2·m2, 2·m1) -> (…, 2, 2, m2, m1)``: the product of stacked rows and columns by kinds."""
    return np.swapaxes(P.reshape(P.shape[:-2] + (2, m2, 2, m1)), -3, -2)


@functools.lru_cache(maxsize=None)
def _leaf_crossings(c: int, dtype) -> np.ndarray:
    """``(c, 2·c·c)`` 0/1: ``[j, (x, t, s)]`` = the leaf's pair (t, s) of row kind x crosses
    step j, ``s < j <= t - x``."""
    x, t, s, j = np.ogrid[:2, :c, :c, :c]
    return ((s < j) & (j <= t - x)).reshape(2 * c * c, c).T.astype(dtype)


@functools.lru_cache(maxsize=None)
def _cut_crossings(m: int, rows: bool, dtype) -> np.ndarray:
    """``(m, 2m)`` 0/1 over a cut's stacked sums [q or k kind, a or b kind]: for its columns
    (``rows`` False) ``s < j`` of either kind; for its rows ``t >= j`` of the q kind, ``t > j``
    of the a kind (an a row reads one step earlier)."""
    if rows:
        return np.concatenate([np.tri(m, dtype=dtype).T, np.tri(m, k=-1, dtype=dtype).T], axis=1)
    return np.concatenate([np.tri(m, k=-1, dtype=dtype)] * 2, axis=1)


def _head_crossings(T: np.ndarray) -> np.ndarray:
    """``dg (…, C)`` of (3) from the pairs' terms ``T (…, 2, C, C)`` by row kind: exclusive
    running sums along the rows, summed over the rows ``tx >= j``."""
    C = T.shape[-1]
    before = T @ np.tri(C, k=-1, dtype=T.dtype).T          # (…,2,C,C) @ (C,C): [x, t, j] = Σ_{s < j} T[x, t, s]
    rows = np.stack([np.tri(C, dtype=bool), np.tri(C, k=-1, dtype=bool)])   # [x, t, j]: j <= t - x
    return (before * rows).sum((-3, -2))


def scores(X, Y, D, e):
    """``A (…, 2, 2, C, C)`` of the module docstring: with one decay a head from its decays
    ``D (…, 2, C, C)`` (:func:`head_decays`); with a decay a channel from the steps' decays
    ``e = exp(g) (…, C, Dk)``."""
    C = X.shape[-2]
    if D is not None:                                               # one decay a head
        XY = X.reshape(X.shape[:-3] + (2 * C, -1)) @ np.swapaxes(Y.reshape(Y.shape[:-3] + (2 * C, -1)), -1, -2)
        return _pairs(XY, C, C) * D[..., :, None, :, :]                    # (…,2C,Dk) @ (…,Dk,2C)
    A = np.zeros(X.shape[:-3] + (2, 2, C, C), X.dtype)
    cuts, leaves = _blocks(C)
    for lo, mid, hi in cuts:
        Xs, _, Ys, _ = _split(X, Y, e, lo, mid, hi)
        A[..., mid:hi, lo:mid] = _pairs(Xs @ np.swapaxes(Ys, -1, -2), hi - mid, mid - lo)   # (…,2m2,Dk) @ (…,Dk,2m1)
    for lo, hi in leaves:
        XE = X[..., lo:hi, None, :] * _leaf_decays(e, lo, hi)          # (…,2,c,c,Dk)
        A[..., lo:hi, lo:hi] = np.einsum("...xtsi,...ysi->...xyts", XE, Y[..., lo:hi, :])
    return A


def scores_backward(dA, X, Y, D, e, A):
    """``(dX, dY, dg)`` from ``dA (…, 2, 2, C, C)`` (read on the masks only): ``dg`` the
    products' part of the decays' gradient, (3), ``(…, C)`` for one decay a head (from
    ``A``), ``(…, C, Dk)`` for a decay a channel."""
    C = X.shape[-2]
    if D is not None:
        dAD = np.swapaxes(dA * D[..., :, None, :, :], -3, -2).reshape(dA.shape[:-4] + (2 * C, 2 * C))
        dX = (dAD @ Y.reshape(Y.shape[:-3] + (2 * C, -1))).reshape(X.shape)                  # (…,2C,2C) @ (…,2C,Dk)
        dY = (np.swapaxes(dAD, -1, -2) @ X.reshape(X.shape[:-3] + (2 * C, -1))).reshape(Y.shape)
        return dX, dY, _head_crossings((dA * A).sum(-3))
    dX, dY = np.zeros_like(X), np.zeros_like(Y)
    dg = np.zeros(X.shape[:-3] + X.shape[-2:], X.dtype)
    cuts, leaves = _blocks(C)
    for lo, mid, hi in cuts:
        Xs, fq, Ys, fy = _split(X, Y, e, lo, mid, hi)
        m2, m1 = hi - mid, mid - lo
        dblk = np.swapaxes(dA[..., mid:hi, lo:mid], -3, -2).reshape(dA.shape[:-4] + (2 * m2, 2 * m1))
        bX = _scale_rows((dblk @ Ys).reshape(X.shape[:-2] + (m2, -1)), fq)   # (…,2m2,2m1) @ (…,2m1,Dk)
        bY = (np.swapaxes(dblk, -1, -2) @ Xs).reshape(Y.shape[:-2] + (m1, -1)) * fy
        dX[..., mid:hi, :] += bX
        dY[..., lo:mid, :] += bY
        cols = (Y[..., lo:mid, :] * bY).reshape(dg.shape[:-2] + (2 * m1, -1))     # j < mid: columns s < j
        dg[..., lo:mid, :] += _cut_crossings(m1, False, X.dtype) @ cols            # (m1,2m1) @ (…,2m1,Dk)
        rows = (X[..., mid:hi, :] * bX).reshape(dg.shape[:-2] + (2 * m2, -1))     # j >= mid: rows tx >= j
        dg[..., mid:hi, :] += _cut_crossings(m2, True, X.dtype) @ rows             # (m2,2m2) @ (…,2m2,Dk)
    for lo, hi in leaves:
        c = hi - lo
        E = _leaf_decays(e, lo, hi)                                        # (…,2,c,c,Dk)
        dAY = np.einsum("...xyts,...ysi->...xtsi", dA[..., lo:hi, lo:hi], Y[..., lo:hi, :])
        dX[..., lo:hi, :] += (dAY * E).sum(-2)
        XE = X[..., lo:hi, None, :] * E
        dY[..., lo:hi, :] += np.einsum("...xyts,...xtsi->...ysi", dA[..., lo:hi, lo:hi], XE)
        terms = (dAY * XE).reshape(dAY.shape[:-4] + (2 * c * c, -1))  # the pairs' terms T (…,2c²,Dk)
        dg[..., lo:hi, :] += _leaf_crossings(c, X.dtype) @ terms   # (c,2c²) @ (…,2c²,Dk)
    return dX, dY, dg
