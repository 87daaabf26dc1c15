"""numba passes of the decay kernel (:mod:`qkv.kernels.decay`); load it through
``qkv.jit.load(qkv.jit.DECAY)`` only.

:func:`pass_states`: the scan that passes the state from chunk to chunk,
``S_{j+1} = exp(Γ_j) ∘ S_j + U_j`` in place (``U_j`` already in ``S[:, j+1]``), one loop over
memory where NumPy takes two calls and a temporary a chunk (at T = 4096 and C = 32 that is
128 steps a head, a fifth of the forward's time). Plain arithmetic, no fast-math: each
number is rounded as NumPy's ``S[j+1] += e * S[j]`` rounds it (the product, then the sum),
so the two paths give the same bits. :func:`scaled_transpose`: the chunks' ``Kgᵀ``.
:func:`finish`: the output, ``(Q S + A V) · row`` out of the panels, one pass a slab (NumPy
took ``o += AV`` and a transposing product: at (1, 8, 4096, 128) about 14 against 5 ms).
"""
from __future__ import annotations

import numba


@numba.njit(cache=True)
def pass_states(S, e_gam, forward):
    """``S (n, J, p, Dk, w)``, ``e_gam (n, J-1, W)`` with W = 1 (a head) or Dk (a key row).
    ``forward``: ``S[:, j+1] += e_gam[:, j] ∘ S[:, j]`` for j = 0 … J-2; else backwards,
    ``S[:, j] += e_gam[:, j] ∘ S[:, j+1]`` for j = J-2 … 0 (the states' gradients)."""
    n, J, p, Dk, w = S.shape
    W = e_gam.shape[2]
    for h in range(n):
        for step in range(J - 1):
            j = step if forward else J - 2 - step
            src, dst = (j, j + 1) if forward else (j + 1, j)
            for a in range(p):
                for d in range(Dk):
                    e = e_gam[h, j, d if W > 1 else 0]
                    for x in range(w):
                        S[h, dst, a, d, x] += e * S[h, src, a, d, x]


@numba.njit(cache=True)
def scaled_transpose(k, e, out):
    """``out[h, j] = (k[h, j] ∘ e[h, j])ᵀ``: ``k (n, Nc, C, Dk)``, ``e (n, Nc, C, W)`` with W = 1
    or Dk, ``out (n, Nc, Dk, C)`` (the chunks' ``Kgᵀ``), one product a number as NumPy's
    ``np.multiply(kᵀ, eᵀ)``, in one pass over a chunk that fits the first cache where NumPy's
    strided one runs at a third of a copy's speed."""
    n, Nc, C, Dk = k.shape
    W = e.shape[3]
    for h in range(n):
        for j in range(Nc):
            for s in range(C):
                for d in range(Dk):
                    out[h, j, d, s] = k[h, j, s, d] * e[h, j, s, d if W > 1 else 0]


@numba.njit(nogil=True, cache=True)
def finish(o, av, row, scale, out, j0):
    """The forward's last pass over a slab of chunks: ``out[h, t, pp·w + x] = (o + av)[h, j, pp, c, x] · f``
    with ``t = (j0 + j)·C + c`` (rows at or past out's T dropped), ``f = row[h, j, c, 0]`` (a
    row of length 0: ``scale``). ``o, av (n, M, p, C, w)``: the state's part and the in-chunk
    part in panels; ``out (n, T, Dv)``, which ``o`` may be a view of (each number is read before
    it is written). The sum, then the product, each rounded as NumPy's ``o += av`` then
    ``o * f`` rounds it: the same bits as NumPy's path, one pass where it took two and a
    transposing copy."""
    n, M, p, C, w = o.shape
    T = out.shape[1]
    rowed = row.shape[0] > 0
    for h in range(n):
        for j in range(M):
            for c in range(C):
                t = (j0 + j) * C + c
                if t >= T:
                    break
                f = row[h, j, c, 0] if rowed else scale
                dst = out[h, t]
                for pp in range(p):
                    src, add = o[h, j, pp, c], av[h, j, pp, c]
                    for x in range(w):
                        dst[pp * w + x] = (src[x] + add[x]) * f
