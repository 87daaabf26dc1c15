"""The decay recurrence in chunks: Mamba-2's SSD, RetNet, GLA, RWKV-6.

**The recurrence** (:mod:`qkv.recurrent.steps` steps it, the oracle)::

    S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ        o_t = scale · S_tᵀ q_t

with ``g_t`` one number a head (broadcast over the key channels) or one a key channel.

**Unrolled inside a chunk.** Cut the sequence into chunks of C positions. In a chunk, with
``S`` the state it starts from, ``G_i = g_1 + ... + g_i`` the log decay from its start to
row i and ``Γ = G_C`` that of the whole chunk::

    S_i  = exp(G_i) ∘ S + Σ_{s <= i} (exp(G_i - G_s) ∘ k_s) v_sᵀ
    o_i  = scale · [ (q_i ∘ exp(G_i))ᵀ S  +  Σ_{s <= i} A_is v_s ]
    A_is = Σ_d q_id k_sd exp(G_id - G_sd)                      (s <= i; 0 above)
    S'   = exp(Γ) ∘ S + Σ_s (k_s ∘ exp(Γ - G_s)) v_sᵀ           the state passed on

(``∘`` on the key axis). With ``Qg = Q ∘ exp(G)`` and ``Kg = K ∘ exp(Γ - G)`` (each factor
in [0, 1]: the decays between row i and the chunk's ends) the chunk is three products::

    O  = scale · (Qg S + A V)            (C,Dk)@(Dk,Dv) and (C,C)@(C,Dv)
    S' = exp(Γ) ∘ S + Kgᵀ V              (Dk,C)@(C,Dv)

``A`` is :mod:`qkv.recurrent.decay.intra`'s masked product (the decays a lower-triangular
factor; for a decay a channel factored about a row between the two). The states are
passed once a chunk: ``U_c = Kg_cᵀ V_c`` for all chunks in one batched product, then the
scan ``S_{c+1} = exp(Γ_c) ∘ S_c + U_c`` (T/C element-wise steps of ``Dk·Dv``). Cost
``O(T·C·D + T·D²)``, memory ``O(T·D + (T/C)·D²)``: the states entering each chunk, the
``(C, C)`` scores of one slab of chunks at a time, never a ``(T, T)`` array.

**Backward.** Let ``dO' = scale · dO`` and ``dS'`` the gradient reaching the state a chunk
passes on (``dstate`` for the last). Reversing the three products::

    dS   = exp(Γ) ∘ dS' + Qgᵀ dO'        the gradient of the state the chunk started from
    dQg  = dO' Sᵀ          dKg = V dS'ᵀ          dV = Kg dS' + Aᵀ dO'
    dA   = dO' Vᵀ (lower triangle)

so the states' gradients run one scan backwards, ``dS_c = exp(Γ_c) ∘ dS_{c+1} + Qg_cᵀ dO'_c``,
``dinitial_state = dS_0``. Through A (decay_intra's rows and cols) ``dq_i += Σ_{s <= i} dA_is
(k_s ∘ exp(G_i - G_s))``, ``dk_s += Σ_{i >= s} dA_is (q_i ∘ exp(G_i - G_s))``; through the
decays, each factor ``exp(G_a - G_b)`` (``a >= b``) depends on the steps ``b < j <= a`` it
crosses and adds ``x · dx`` of the term x it multiplies to ``dg_j`` for exactly those j
(:mod:`qkv.recurrent.crossing`)::

    dg_j = Σ_{i >= j} dQg_i ∘ Qg_i + Σ_{s < j} dKg_s ∘ Kg_s + exp(Γ) ∘ Σ_v dS'_v S_v
           + Σ_{s < j <= i} dA_is q_i ∘ k_s ∘ exp(G_i - G_s)

(over the key channels too for a decay a head): every summand carries the decays crossing j,
so a steep decay's tiny ``dg_j`` is a sum of tiny terms, not what is left of undecayed terms
that cancel (``Σ_{i >= j} dG_i`` of ``dG = q ∘ dq - k ∘ dk + ...``). float32 and the ``fast`` extra: two compiled
sweeps (:mod:`qkv.recurrent.decay.fused`'s ``backward``, ``backward_channels``; their own bits, tested).

**Padding.** T is padded to whole chunks with ``q = k = v = 0`` and ``g = 0`` at the end:
the padded rows add nothing to the state and decay nothing, so ``S_T`` and every real row
are exact; their outputs and gradients are dropped. A log decay below :data:`FLOOR` is
raised to it before the sums (its exp is 0 either way), so no sum of them reaches ``-inf``.

**The forward's layout.** For a decay a head, ``O = scale · (Qg S + A V)`` is computed as
``scale · exp(G) ∘ (Q S + A' V)`` with ``A' = tril(Q Kgᵀ) · exp(-Γ)`` (decay_intra's
``scores_unrowed``): the rows' ``exp(G_i)`` multiply the finished output once, with the
scale. Where NumPy's OpenBLAS has small-matrix kernels (its AVX-512 cores) and Dv is a larger
multiple of :data:`PANEL`, values, states and outputs are cut into panels of :data:`PANEL`
columns, each product one those kernels take. With the ``fast`` extra, float32 and a decay a
head run chunk after chunk in one compiled loop (:mod:`qkv.recurrent.decay.fused`: NumPy's bits
but where its Haswell kernels round merged products), else the scan and last pass, NumPy's bits.

**Work.** The ``B·H`` heads are cut into units (whole heads, at least :data:`UNIT_ROWS`
positions where T is short) on the kernel threads, BLAS held to one thread; units depend on the
problem alone, so the bits do not depend on the thread count. float32 inputs compute in float32,
float64 in float64; the cumulative log decays are summed in float64 (:mod:`qkv.recurrent.decay.intra`).
"""
from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import numpy as np

from ... import jit, threads
from .. import crossing, units
from . import fused as decay_fused, intra as decay_intra
from ...kernels.flash.tiles import DEFAULT, Workers, scratch

CHUNK = 64          # rows a chunk by default where Dk > 64; 32 for Dk <= 64 (measured: 3.5 and 1.9x
                    # the peer against 3.3 and 1.6x with 64 at D = 64, forward; equal forward+backward)
UNIT_ROWS = 4096    # positions (heads × T) a work unit holds at least, where there are enough
SLAB_ROWS = 2048    # positions of the chunks whose in-chunk scores are made at once
FLOOR = -1000.0     # log decays below are raised to it: exp(-1000) is 0 in float64 already
KEEP = 1 << 21      # elements of the largest work array a thread keeps between calls
PANEL = 64          # columns of a value panel (see _forward_unit): OpenBLAS's small-matrix kernels (AVX-512) take a
                    # product of M·N·K <= 10^6 only; at D = 128, C = 64 the state's two are 64·128·128, in panels half
PANELS = None       # True/False: panels or not; None: as the BLAS core (D = 128: 0.85x the time on SkylakeX, 1.05x on Haswell)
SEGMENT_ROWS = 4096 # positions of a head whose chunks the forward works at once; a longer sequence runs segment
                    # after segment, the state passed on, so its work arrays stay within KEEP and are reused


def _t(x):
    return np.swapaxes(x, -1, -2)


def _buffer(shape: tuple, dtype, slot: str) -> np.ndarray:
    """A work array, uninitialised: per-thread and reused call after call up to
    :data:`KEEP` elements (a fresh array of megabytes costs its page faults again each
    time), a fresh one beyond (not held after the call)."""
    size = int(np.prod(shape))
    if size > KEEP:
        return np.empty(shape, dtype)
    return scratch(size, dtype, DEFAULT, "decay_" + slot).reshape(shape)


@dataclasses.dataclass
class _Chunks:
    """One unit's heads in chunks: ``q, k (n,Nc,C,Dk)``, ``v (n,Nc,C,Dv)``, ``G (n,Nc,C,W)``
    the float64 cumulative log decays from each chunk's start (W = 1 or Dk), the factors
    ``eG = exp(G)``, ``eK = exp(Γ - G)`` and ``eGam = exp(Γ) (n,Nc,W)``, and for a decay a
    channel the step decays ``a = exp(g) (n,Nc,C,Dk)``; ``Qg = q ∘ eG``, ``Kg = k ∘ eK``, and
    ``KgT`` its transpose ``(n,Nc,Dk,C)`` made contiguous: the forward's two products with
    ``Kgᵀ`` (``U = Kgᵀ V``, ``Qg Kgᵀ``) then take both operands as stored, which OpenBLAS
    runs up to twice as fast at C = 64 as the transposed view (measured: 0.59 against 1.0-1.5
    ms for a head's ``Qg Kgᵀ`` at T = 4096, D = 128)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    G: np.ndarray
    eG: np.ndarray
    eK: np.ndarray
    eGam: np.ndarray
    a: np.ndarray | None

    @cached_property
    def Qg(self):
        return np.multiply(self.q, self.eG, out=_buffer(self.q.shape, self.q.dtype, "Qg"))

    @cached_property
    def Kg(self):
        return np.multiply(self.k, self.eK, out=_buffer(self.k.shape, self.k.dtype, "Kg"))

    @cached_property
    def KgT(self):
        n, Nc, C, Dk = self.k.shape
        out = _buffer((n, Nc, Dk, C), self.k.dtype, "KgT")
        mod = jit.load(jit.DECAY)
        if mod is not None and self.k.dtype in (np.float32, np.float64):
            mod.scaled_transpose(self.k, self.eK, out)                   # the same products, a third the time
            return out
        return np.multiply(_t(self.k), _t(self.eK), out=out)


def _split(x: np.ndarray, C: int) -> np.ndarray:
    """``(n, T, ·) -> (n, Nc, C, ·)``, zero rows appended to whole chunks."""
    n, T = x.shape[:2]
    pad = -T % C
    if pad:
        x = np.concatenate([x, np.zeros((n, pad) + x.shape[2:], x.dtype)], axis=1)
    return x.reshape((n, -1, C) + x.shape[2:])


def _chunks(q, k, v, g, C) -> _Chunks:
    dt = q.dtype
    G = decay_intra.cumulative(_split(g, C), FLOOR)                       # (n,Nc,C,W) float64
    Gam = G[:, :, -1:]                                                    # (n,Nc,1,W)
    ex = decay_intra.decayed if g.shape[-1] > 1 else decay_intra.factors  # a head's: rounded once (factors())
    eG = ex(G, dt)                                                        # (float32: 0 below 2^-60)
    eK = ex(Gam - G, dt)
    a = np.exp(_split(g, C)) if g.shape[-1] > 1 else None                # (n,Nc,C,Dk): a decay a channel
    return _Chunks(_split(q, C), _split(k, C), _split(v, C), G, eG, eK, ex(Gam[:, :, 0], dt), a)


def _panels(Dv: int) -> int:
    """Panels of :data:`PANEL` columns the forward cuts the values, states and outputs into:
    where :data:`PANELS` (None: where NumPy's OpenBLAS has small-matrix kernels, :func:`qkv.threads.small_products`)
    and Dv is a larger multiple of :data:`PANEL`; else 1."""
    on = PANELS if PANELS is not None else threads.small_products()
    return Dv // PANEL if on and Dv > PANEL and Dv % PANEL == 0 else 1


def _pass_states(S: np.ndarray, e_gam: np.ndarray, forward: bool = True) -> None:
    """``S (n, Nc+1, p, Dk, w)`` in place: forward ``S_{j+1} += exp(Γ_j) ∘ S_j`` (``S_{j+1}``
    holding ``U_j``), or backward ``dS_j += exp(Γ_j) ∘ dS_{j+1}``; ``e_gam (n, Nc, W)``.
    Compiled where the ``fast`` extra is (:mod:`qkv.recurrent.decay.compiled`, the same bits)."""
    mod = jit.load(jit.DECAY)
    if mod is not None and S.dtype in (np.float32, np.float64):
        mod.pass_states(S, e_gam, forward)
        return
    e = e_gam[:, :, None, :, None]                                        # (n,Nc,1,W,1)
    for j in range(S.shape[1] - 1) if forward else reversed(range(S.shape[1] - 1)):
        if forward:
            S[:, j + 1] += e[:, j] * S[:, j]
        else:
            S[:, j] += e[:, j] * S[:, j + 1]


def _states(c: _Chunks, S0) -> np.ndarray:
    """The state entering each chunk and the final one: ``(n, Nc+1, Dk, Dv)`` (the backward's)."""
    n, Nc = c.q.shape[:2]
    Dk, Dv = c.q.shape[-1], c.v.shape[-1]
    S = _buffer((n, Nc + 1, Dk, Dv), c.q.dtype, "S")
    S[:, 0] = 0 if S0 is None else S0
    np.matmul(c.KgT, c.v, out=S[:, 1:])                                   # U: (n,Nc,Dk,C) @ (n,Nc,C,Dv) -> (n,Nc,Dk,Dv)
    _pass_states(S.reshape(n, Nc + 1, 1, Dk, Dv), c.eGam)                # S_{j+1} = exp(Γ_j) ∘ S_j + U_j
    return S


def _slab_chunks(n: int, C: int, W: int) -> int:
    """Chunks of a slab: those whose in-chunk products are made at once (a quarter as many
    rows for a decay a channel: its diagonal blocks hold ``SUB·Dk`` numbers a row)."""
    return max(1, (SLAB_ROWS if W == 1 else SLAB_ROWS // 4) // (n * C))


def _slabs(n: int, Nc: int, C: int, W: int):
    """Chunk ranges ``[a, b)`` of the slabs (:func:`_slab_chunks`)."""
    per = _slab_chunks(n, C, W)
    return [(a, min(a + per, Nc)) for a in range(0, Nc, per)]


def _forward_unit(q, k, v, g, S0, scale, C, out):
    """One unit: ``q, k (n,T,Dk)``, ``v (n,T,Dv)``, ``g (n,T,W)``; o into ``out (n,T,Dv)``;
    returns ``S_T``. Values, states and outputs in :func:`_panels` ``(.., p, ·, w)``; for a
    decay a head the rows' ``exp(G_i)`` multiply the finished output rows (with the scale)
    instead of q: ``o_i = scale · exp(G_i) (q_i S + A'_i V)``, ``A'`` the scores without it."""
    T = q.shape[1]
    c = _chunks(q, k, v, g, C)
    n, Nc, _, Dk = c.q.shape
    Dv, dt, head = c.v.shape[-1], q.dtype, c.G.shape[-1] == 1
    p = _panels(Dv)
    w = Dv // p
    if head and (S_T := decay_fused.forward(c, S0, scale, out, p, _slabs(n, Nc, C, 1))) is not None:
        return S_T                                                        # compiled: the same bits
    vp = c.v[:, :, None]                                                  # (n,Nc,p,C,w)
    if p > 1:
        vp = _buffer((n, Nc, p, C, w), dt, "vp")
        np.copyto(vp, c.v.reshape(n, Nc, C, p, w).swapaxes(2, 3))
    S = _buffer((n, Nc + 1, p, Dk, w), dt, "S")
    S[:, 0] = 0 if S0 is None else S0.reshape(n, Dk, p, w).swapaxes(1, 2)
    np.matmul(c.KgT[:, :, None], vp, out=S[:, 1:])                       # U: (n,Nc,1,Dk,C) @ (n,Nc,p,C,w)
    _pass_states(S, c.eGam)
    direct = p == 1 and T % C == 0                                        # o is out itself
    o = _view(out, (n, Nc, 1, C, Dv)) if direct else _buffer((n, Nc, p, C, w), dt, "o")
    np.matmul((c.q if head else c.Qg)[:, :, None], S[:, :Nc], out=o)     # (n,Nc,1,C,Dk) @ (n,Nc,p,Dk,w)
    row = c.eG * dt.type(scale) if head else None                        # (n,Nc,C,1)
    mod = jit.load(jit.DECAY) if dt in (np.float32, np.float64) else None  # the last pass compiled
    for a, b in _slabs(n, Nc, C, c.G.shape[-1]):
        dec = decay_intra.decay(c.G[:, a:b], None if c.a is None else c.a[:, a:b], dt)
        if head:                                                          # a factored chunk's rows take exp(G_i) last
            A = dec.forward_scores(c.q[:, a:b], c.k[:, a:b], c.KgT[:, a:b], o[:, a:b], row[:, a:b], c.eG[:, a:b], scale)
        else:
            A = dec.scores(c.q[:, a:b], c.k[:, a:b], None, None)
        AV = np.matmul(A[:, :, None], vp[:, a:b], out=_buffer((n, b - a, p, C, w), dt, "AV"))
        if mod is None:
            o[:, a:b] += AV
            continue
        mod.finish(o[:, a:b], AV, row[:, a:b] if head else np.empty((0, 0, 0, 1), dt), dt.type(scale), out, a)
    if mod is not None or direct:                                         # direct: o is out
        if mod is None:
            np.multiply(o, row[:, :, None] if head else dt.type(scale), out=o)
        return S[:, Nc, 0] if p == 1 else S[:, Nc].swapaxes(1, 2).reshape(n, Dk, Dv)
    res = o.swapaxes(2, 3)                                                # (n,Nc,C,p,w)
    fac = row[..., None] if head else dt.type(scale)
    if T % C == 0:
        np.multiply(res, fac, out=_view(out, (n, Nc, C, p, w)))
    else:
        out[:] = np.multiply(res, fac).reshape(n, Nc * C, Dv)[:, :T]
    return S[:, Nc].swapaxes(1, 2).reshape(n, Dk, Dv)


def _view(x: np.ndarray, shape: tuple) -> np.ndarray:  # x seen with shape (axes split), never a copy
    y = x.view()
    y.shape = shape
    return y


def _grad_states(c: _Chunks, dO, dstate) -> np.ndarray:
    """``dS[:, j]`` the gradient of the state entering chunk j (j = Nc: the final state)."""
    n, Nc = c.q.shape[:2]
    dS = _buffer((n, Nc + 1, c.q.shape[-1], c.v.shape[-1]), c.q.dtype, "dS")
    dS[:, Nc] = 0 if dstate is None else dstate
    np.matmul(_t(c.Qg), dO, out=dS[:, :Nc])                                # R: (n,Nc,Dk,C) @ (n,Nc,C,Dv) -> (n,Nc,Dk,Dv)
    _pass_states(dS.reshape((n, Nc + 1, 1) + dS.shape[2:]), c.eGam, forward=False)  # dS_j = exp(Γ_j) ∘ dS_{j+1} + R_j
    return dS


def _backward_unit(dout, dstate, q, k, v, g, S0, scale, C, into):
    """One unit's ``(dq, dk, dv, dg, dS0)``, shapes as its inputs; () where :mod:`.fused` wrote them into ``into``."""
    T, W = q.shape[1], g.shape[-1]
    if W > 1 and q.dtype == np.float32 and decay_fused.backward_channels(
            *(_split(x, C) for x in (q, k, v, g, dout)), dstate, S0, scale, into):
        return ()
    c = _chunks(q, k, v, g, C)
    if W == 1 and decay_fused.backward(c, _split(dout, C), dstate, S0, scale, into):
        return ()
    n, Nc = c.q.shape[:2]
    S = _states(c, S0)
    dO = _split(dout, C) * q.dtype.type(scale)                            # dO' (n,Nc,C,Dv)
    dS = _grad_states(c, dO, dstate)
    Qg, Kg, dS_out = c.Qg, c.Kg, dS[:, 1:]
    dQg = dO @ _t(S[:, :Nc])                                              # (n,Nc,C,Dv) @ (n,Nc,Dv,Dk) -> (n,Nc,C,Dk)
    dKg = c.v @ _t(dS_out)                                                # (n,Nc,C,Dv) @ (n,Nc,Dv,Dk) -> (n,Nc,C,Dk)
    dv = Kg @ dS_out                                                      # (n,Nc,C,Dk) @ (n,Nc,Dk,Dv) -> (n,Nc,C,Dv)
    dq, dk = dQg * c.eG, dKg * c.eK
    rows_after = crossing.to_width(dQg * Qg, W)                         # Qg_i's exp(G_i): Σ_{i >= j} (crossing.py)
    rows_before = crossing.to_width(dKg * Kg, W)                        # Kg_s's exp(Γ - G_s): Σ_{s < j}
    dGam = crossing.to_width(np.einsum("ncdv,ncdv->ncd", dS_out, S[:, :Nc]), W) * c.eGam  # exp(Γ) ∘ S: every j
    pairs = np.zeros(c.G.shape, q.dtype)                                 # Σ_{s < j <= i} of A's pairs
    for a, b in _slabs(n, Nc, C, c.G.shape[-1]):
        dec = decay_intra.decay(c.G[:, a:b], None if c.a is None else c.a[:, a:b], q.dtype)
        qa, ka, dOa = c.q[:, a:b], c.k[:, a:b], dO[:, a:b]
        A = dec.scores(qa, ka, Qg[:, a:b], c.KgT[:, a:b])
        dv[:, a:b] += _t(A) @ dOa                                          # Aᵀ dO': (n,M,C,C) @ (n,M,C,Dv)
        dA = dOa @ _t(c.v[:, a:b])                                         # (n,M,C,Dv) @ (n,M,Dv,C) -> (n,M,C,C)
        dqA, dkA, pairs[:, a:b] = dec.grads(dA, qa, ka, A)                 # A's share of dq, dk and dg
        dq[:, a:b] += dqA
        dk[:, a:b] += dkA
    dg = crossing.later(rows_after, 2) + crossing.earlier(rows_before, 2) + pairs + dGam[:, :, None]
    cut = lambda x: x.reshape((n, Nc * C) + x.shape[3:])[:, :T]           # noqa: E731
    return cut(dq), cut(dk), cut(dv), cut(dg), dS[:, 0]


def _flat(g, state, N: int, T: int):
    """g ``(B,H,T[,Dk]) -> (N,T,W)``; the state ``(B,H,Dk,Dv) -> (N,Dk,Dv)`` or None."""
    g3 = g.reshape(N, T, g.shape[-1] if g.ndim == 4 else 1)
    return g3, None if state is None else state.reshape(N, state.shape[-2], -1)


def _units(N: int, T: int):
    per = max(1, -(-UNIT_ROWS // max(T, 1)))
    return [(a, min(a + per, N)) for a in range(0, N, per)]


def _chunk_size(chunk, T: int, Dk: int) -> int:
    """The chunk's rows: ``chunk`` (None: :data:`CHUNK`, halved for Dk <= 64, where the
    ``(C, C)`` products would cost as much as the state's), at most T (a short call, a
    decoding step, pads nothing)."""
    default = CHUNK if Dk > 64 else CHUNK // 2
    return max(1, min(default if chunk is None else int(chunk), T))


def _segments(T: int, C: int):
    """``[t0, t1)`` ranges of at most :data:`SEGMENT_ROWS` positions (whole chunks) covering T.

    Cutting a sequence between chunks changes nothing: a segment starts from the state the
    one before it ended with, exactly the state its first chunk would have entered, and the
    chunks, slabs and products are the same (a segment is a whole number of slabs of one
    head, of either decay's width), so the bits are those of one pass over the whole sequence."""
    slab = math.lcm(_slab_chunks(1, C, 1), _slab_chunks(1, C, 2))          # chunks
    step = max(1, SEGMENT_ROWS // (slab * C)) * slab * C
    return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)]


def _run(N, T, C, job):
    with Workers(None, N * T * C, DEFAULT) as w:
        w.run([lambda a=a, b=b: job(a, b) for a, b in _units(N, T)])


def forward(q, k, v, g, *, scale, initial_state=None, chunk=None):
    """``(o (B,H,T,Dv), S_T (B,H,Dk,Dv))`` in q's dtype (float32 or float64); q, k, v in any
    layout (:func:`qkv.recurrent.units.rows`: a broadcast q or k is never copied whole, its one head once)."""
    B, H, T, Dk = q.shape
    C = _chunk_size(chunk, T, Dk)
    gf, S0 = _flat(g, initial_state, B * H, T)
    o = np.empty((B * H, T, v.shape[-1]), q.dtype)
    S_T = np.empty((B * H, Dk, v.shape[-1]), q.dtype)
    q, k, v = (units.shared_once(x) for x in (q, k, v))

    def job(a, b):
        S = None if S0 is None else S0[a:b]
        for t0, t1 in _segments(T, C):
            q_, k_, v_ = (units.rows(x, a, b, t0, t1, lambda shape, dt, n=n: _buffer(shape, dt, "in_" + n))
                          for x, n in ((q, "q"), (k, "k"), (v, "v")))
            S = _forward_unit(q_, k_, v_, gf[a:b, t0:t1], S, scale, C, o[a:b, t0:t1])
        S_T[a:b] = S

    _run(B * H, T, C, job)
    return o.reshape(v.shape), S_T.reshape(B, H, Dk, -1)


def backward(dout, dstate, q, k, v, g, *, scale, initial_state=None, chunk=None):
    """``(dq, dk, dv, dg, dinitial_state)`` in q's dtype; dinitial_state None without one."""
    B, H, T, Dk = q.shape
    C = _chunk_size(decay_fused.backward_chunk(q.dtype, g.ndim == 3, Dk, v.shape[-1]) if chunk is None else chunk, T, Dk)
    qf, kf, vf = (x.reshape((B * H, T, -1)) for x in (q, k, v))
    gf, S0 = _flat(g, initial_state, B * H, T)
    dof = dout.reshape(vf.shape)
    dSf = None if dstate is None else dstate.reshape(B * H, Dk, -1)
    out = [np.empty(x.shape, q.dtype) for x in (qf, kf, vf, gf)] + [np.empty((B * H, Dk, vf.shape[-1]), q.dtype)]

    def job(a, b):
        grads = _backward_unit(dof[a:b], None if dSf is None else dSf[a:b], qf[a:b], kf[a:b], vf[a:b],
                               gf[a:b], None if S0 is None else S0[a:b], scale, C, [x[a:b] for x in out])
        for dst, src in zip(out, grads):
            dst[a:b] = src

    _run(B * H, T, C, job)
    dq, dk, dv, dg, dS0 = out
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            None if initial_state is None else dS0.reshape(initial_state.shape))
