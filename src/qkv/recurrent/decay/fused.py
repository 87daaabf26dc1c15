"""The decay recurrence's compiled path (float32, a decay a head; the backward also a key channel): every
chunk of a work unit in one compiled loop, BLAS called from it (:func:`qkv.recurrent.decay.compiled.forward_chunks`),
and its backward in two such loops (:func:`backward`, :func:`backward_channels`).

:func:`qkv.recurrent.decay.chunk._forward_unit` makes each of its steps for every chunk of a segment
at once: the chunks' ``Kgᵀ``, then ``U = Kgᵀ V``, the states' scan, ``Q S``, the scores, ``A V``
and the last pass, each a pass over megabytes that the next reads back from memory. The
compiled loop takes a chunk through all of them while its arrays are in cache, and keeps one
state where the NumPy path stores every chunk's. It makes the same products (NumPy's own
``sgemm``) and the same element-wise roundings in the same order. In panels
(``forward_chunks``) its bits are the NumPy path's; in one panel (``forward_merged``, every
Dv on OpenBLAS's Haswell kernels, Dv <= 64 on its AVX-512 ones) products that share an
operand are made as one, two a chunk where there were four, which OpenBLAS's AVX-512 kernels
round as the NumPy path's four and its Haswell kernels within float32's rounding of them
(measured as AVX2: 1.12x at D = 128, 1.19x at D = 64; tested). Where numba or NumPy's BLAS cannot be had,
or the inputs are float64 or decay a key channel, :func:`forward` gives None and the NumPy
path runs. So it does (*) where NumPy's ``matmul`` would not call ``sgemm``, whose bits the
loop could not give: a product with one row or one column (NumPy calls ``gemv``: chunks of
one row, a decoding step's) and ``q`` the same memory as ``k`` (``q kᵀ`` is then ``syrk``).

**The backward** keeps no NumPy bits: a first sweep forwards stores each chunk's start state
beside its values, both transposed (``[S_jᵀ | V_jᵀ]``), a second backwards takes each chunk through
every step of :mod:`qkv.recurrent.decay.chunk`'s backward while its blocks are in cache, the state's
gradient kept transposed beside ``dO'ᵀ``, the products that share an operand made as one:
``dv = [Kg | Aᵀ] [dS'; dO']`` and ``[dQg | dA] = dO' [Sᵀ | Vᵀ]``, eight products a chunk in all.
No product reads an operand along its rows (``A Bᵀ``): OpenBLAS's SkylakeX (AVX-512) kernels
take a product of at most 10^6 multiply-adds into small-matrix kernels, which run ``A Bᵀ`` at
about half the speed of ``A B`` and ``Aᵀ B``; with chunks of :data:`BACKWARD_CHUNK` = 32 rows
(where the caller gives none; the forward's are 64 past Dk = 64) every product of the backward
at D = 128 is one of those. It makes 2.1 times the forward's multiply-adds then (``10 C D + 10 D²``
a row against the forward's ``4 C D + 4 D²`` at C = 64; 2.5 times at 64 on both sides), so
forward+backward costs about 3.1 forwards at equal rates (3.5 before). At (1, 8, 2048, 128), one thread, Intel Xeon model 207
(AVX-512): 3.3-3.4x the forward (was 3.8-3.9x with chunks of 64 read along their rows; 47-50
against 38-41 ms); as AVX2 (OpenBLAS's Haswell kernels, where both layouts run alike) 3.4-3.5x
either way. On Zen 3 (AVX2) with the old layout: 2.8-3.0x in a loaded run, 3.4-3.6x alone.
Tested against the float64 oracle.
:func:`backward_channels` does the same for a decay a key channel (GLA, RWKV-6) with the passes of
:mod:`qkv.recurrent.decay.channel_compiled`: the decays applied element by element, the in-chunk part
row by row without BLAS (forward+backward 2.2-2.3x the forward at that shape, was 4.0-4.7x).
"""
from __future__ import annotations

import numpy as np

from ... import jit
from ...kernels.flash.tiles import DEFAULT, scratch
from . import intra as decay_intra

KEEP = 1 << 21      # elements of the backward's states a thread keeps between calls (as chunk.KEEP)
BACKWARD_CHUNK = 32 # the compiled backward's chunk (a decay a head) where the caller gives none (module docstring)


def forward(c, S0, scale: float, out: np.ndarray, p: int, slabs) -> np.ndarray | None:
    """The state after the last chunk ``(n, Dk, Dv)``, the outputs written into ``out (n, T, Dv)``;
    or None where this path does not apply. ``c``: the unit's :class:`qkv.recurrent.decay.chunk._Chunks`
    (a decay a head); ``p``: the value panels; ``slabs``: the chunk ranges whose decays are made
    at once, as the NumPy path's slabs; each chunk of a head takes the rank-one factors or the mask
    as its own decay says (:class:`qkv.recurrent.decay.intra.HeadDecay`)."""
    n, Nc, C, Dk = c.q.shape
    Dv = c.v.shape[-1]
    w = Dv // p
    if c.q.dtype != np.float32 or c.a is not None or min(C, Dk, w) < 2 or np.may_share_memory(c.q, c.k):
        return None                                                      # (*)
    mod = jit.load(jit.DECAY)
    if mod is None or not (mod.SGEMM and mod.ILP64):                  # NumPy's own sgemm only: its bits
        return None
    mode = np.zeros((n, Nc), np.int8)
    em_gam = np.zeros((n, Nc), np.float32)
    D = np.zeros((0, 0, 0, 0), np.float32)                              # the masks, read where mode is 0 only
    if (c.G[:, :, -1, 0] < -decay_intra.LIMIT).any():
        size = n * Nc * C * C
        D = (scratch(size, np.float32, DEFAULT, "decay_D_unit") if size <= KEEP else np.empty(size, np.float32))
        D = D.reshape(n, Nc, C, C)
    for a, b in slabs:                                                   # each chunk of a head its own kind
        dec = decay_intra.decay(c.G[:, a:b], None, np.dtype(np.float32))
        mode[:, a:b] = dec.chunks(em_gam[:, a:b], D[:, a:b] if D.size else None)
    S = np.zeros((n, p, Dk, w), np.float32)
    if S0 is not None:
        S[:] = S0.reshape(n, Dk, p, w).swapaxes(1, 2)
    f = np.float32(scale)
    loop = mod.forward_merged if p == 1 else mod.forward_chunks          # one panel: two products a chunk
    loop((mod.SGEMM, int(mod.ILP64)), c.q, c.k, c.v, c.eG, c.eK, c.eG * f, c.eGam, em_gam, mode, D,
         np.tri(C, dtype=np.float32), S, out, f)
    return S[:, 0] if p == 1 else S.swapaxes(1, 2).reshape(n, Dk, Dv)


def backward_chunk(dtype, head: bool, Dk: int, Dv: int) -> int | None:
    """:data:`BACKWARD_CHUNK` where :func:`backward` runs for a caller who gives no chunk (float32, a decay a
    head, no size below 2, numba and NumPy's ``sgemm``), else None: the forward's chunk."""
    if np.dtype(dtype) != np.float32 or not head or min(Dk, Dv) < 2:
        return None
    mod = jit.load(jit.DECAY)
    return BACKWARD_CHUNK if mod is not None and mod.SGEMM else None


def backward(c, dO, dstate, S0, scale: float, into) -> bool:
    """The backward of a decay a head in float32 from two compiled sweeps over the chunks
    (:func:`qkv.recurrent.decay.compiled.backward_states` forwards, ``backward_chunks`` backwards),
    ``(dq, dk, dv, dg, dS0)`` written into ``into`` (the unit's, shapes as
    :func:`qkv.recurrent.decay.chunk._backward_unit` gives them); False where it does not run
    (float64, a decay a key channel, a size below 2, no numba or BLAS: the NumPy path). ``c``: the
    unit's chunks; ``dO (n, Nc, C, Dv)`` the output's gradient in chunks (without the scale). Its
    bits are not the NumPy path's (float32 sums in other orders, the decays' exp a polynomial):
    tested against the float64 oracle."""
    n, Nc, C, Dk = c.q.shape
    Dv, T = c.v.shape[-1], into[0].shape[1]
    mod = jit.load(jit.DECAY)
    if c.q.dtype != np.float32 or c.a is not None or min(C, Dk, Dv) < 2 or mod is None or not mod.SGEMM:
        return False
    f, addr, con = np.float32, (mod.SGEMM, int(mod.ILP64)), np.ascontiguousarray
    q, k, v, dO = con(c.q), con(c.k), con(c.v), con(dO)
    eG, eK, e_gam = con(c.eG[..., 0]), con(c.eK[..., 0]), con(c.eGam[..., 0])
    S = np.zeros((n, Dk, Dv), f) if S0 is None else con(S0, f)
    size = n * Nc * Dv * (Dk + C)                                         # [S_jᵀ | V_jᵀ] a chunk, reused
    starts = (scratch(size, f, DEFAULT, "decay_starts") if size <= KEEP else np.empty(size, f)).reshape(n, Nc, Dv, -1)
    mod.backward_states(addr, k, v, eK, e_gam, S, starts)
    dS = into[4]
    dS[:] = 0 if dstate is None else dstate
    whole = T == Nc * C and all(x.flags.c_contiguous for x in into[:4])  # the gradients written in place
    dq, dk, dv, dg = ((x.reshape(n, Nc, C, -1) if whole else np.empty((n, Nc, C, x.shape[-1]), f)) for x in into[:4])
    mod.backward_chunks(addr, q, k, v, dO, con(c.G[..., 0]), eG, eK, e_gam, starts, f(scale), dS, dq, dk, dv,
                        dg[..., 0])
    if not whole:
        for dst, src in zip(into[:4], (dq, dk, dv, dg)):
            dst[:] = src.reshape(n, Nc * C, -1)[:, :T]
    return True


def backward_channels(q, k, v, g, dO, dstate, S0, scale: float, into) -> bool:
    """:func:`backward` for a decay a key channel (:mod:`qkv.recurrent.decay.channel_compiled`): ``q, k, g
    (n, Nc, C, Dk)``, ``v, dO (n, Nc, C, Dv)`` in chunks (padded with zeros: ``g = 0`` decays nothing), the
    decays made from ``a = exp(g)`` by running products; False where it does not run (as :func:`backward`)."""
    n, Nc, C, Dk = q.shape
    Dv, T = v.shape[-1], into[0].shape[1]
    mod = jit.load(jit.DECAY_CHANNELS)
    if q.dtype != np.float32 or min(C, Dk, Dv) < 2 or mod is None or not mod.SGEMM:
        return False
    f, addr, con = np.float32, (mod.SGEMM, int(mod.ILP64)), np.ascontiguousarray
    q, k, v, dO = con(q), con(k), con(v), con(dO)
    a = np.exp(g.astype(f, copy=False))                                   # (n,Nc,C,Dk) the step decays, in [0, 1]
    S = np.zeros((n, Dk, Dv), f) if S0 is None else con(S0, f)
    size = n * Nc * (Dk + C) * Dv                                         # [S_j; V_j] a chunk, reused
    starts = (scratch(size, f, DEFAULT, "decay_starts") if size <= KEEP else np.empty(size, f)).reshape(n, Nc, -1, Dv)
    mod.backward_states(addr, k, v, a, S, starts)
    dS = into[4]
    dS[:] = 0 if dstate is None else dstate
    whole = T == Nc * C and all(x.flags.c_contiguous for x in into[:4])  # the gradients written in place
    dq, dk, dv, dg = ((x.reshape(n, Nc, C, -1) if whole else np.empty((n, Nc, C, x.shape[-1]), f)) for x in into[:4])
    mod.backward_chunks(addr, q, k, v, dO, a, starts, f(scale), dS, dq, dk, dv, dg)
    if not whole:
        for dst, src in zip(into[:4], (dq, dk, dv, dg)):
            dst[:] = src.reshape(n, Nc * C, -1)[:, :T]
    return True
