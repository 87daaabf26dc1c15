"""Short sequences in big batches: the dense, exact computation of :mod:`.reference`, cut
into work units that each stack many (batch, head) pairs.

At T of a few hundred a (batch, head) pair is a fraction of one of the tiled kernel's tiles,
and the ~50 small NumPy calls of a tile, not the arithmetic, cost the time; the dense path
over every head at once materialises ``(B, H, Tq, Tk)`` scores and pays in memory traffic.
Here the leading axes are flattened to one stack ``(N, T, D)`` and cut into units of
pairs whose scores fit in a core's L2 cache (:data:`UNIT_ENTRIES`); each unit computes
:mod:`.reference`'s equations with one stacked ``np.matmul`` over its heads for each product
and one in-place element-wise pass over the stack for each softmax step (one score buffer,
not a new array a step). The units run on the kernel threads with BLAS held to one thread.

Bits: the units depend on the problem alone (never on the thread count), a stacked
``np.matmul`` multiplies each head by itself, and BLAS runs single-threaded, so every
thread count gives the same bits, the same as :mod:`.reference` on the whole problem.

Only masks that are the same for every head (causal, window, chunk, one alignment offset)
are stacked; masks, biases, ALiBi, lengths, softcap and dropout go by :func:`applies` to
another kernel.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import reference
from .flash.tiles import DEFAULT, Workers
from ..masks import MaskSpec

UNIT_ENTRIES = 1 << 16   # score entries of one work unit (256 KiB in float32; with dP, 512 KiB of a 1 MiB L2)


def applies(spec: MaskSpec) -> bool:
    """True when the mask is the same for every (batch, head) pair, so heads can be stacked."""
    return (spec.mask is None and spec.bias is None and spec.alibi is None and spec.kv_lengths is None
            and spec.q_lengths is None and not isinstance(spec.offset, np.ndarray)
            and spec.plain_scores)  # softcap and dropout: the reference and the tiled kernel


def _units(n: int, tq: int, tk: int, group: int) -> list[tuple[int, int]]:
    """Query-head ranges ``[a, b)`` of the stack, each a whole number of kv groups, at most
    :data:`UNIT_ENTRIES` scores each (one head at least). They depend on the problem alone,
    never on the threads."""
    per = max(1, UNIT_ENTRIES // (tq * tk) // group) * group
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def _flat(x: np.ndarray) -> np.ndarray:
    """``(*L, T, D) -> (N, T, D)`` (a view where the layout allows)."""
    return x.reshape((-1,) + x.shape[-2:])


def forward(q, k, v, spec: MaskSpec, scale: float, group: int = 1, return_weights: bool = False,
            num_threads: int | None = None):
    """As :func:`reference.forward` (no weights): ``(out (*L,Tq,Dv), lse (*L,Tq), None)``."""
    lead, tq, tk, dv = spec.lead, spec.tq, spec.tk, v.shape[-1]
    qf, kf, vf = _flat(q), _flat(k), _flat(v)      # (N,Tq,D), (N/G,Tk,D), (N/G,Tk,Dv)
    n = qf.shape[0]
    out = np.empty((n, tq, dv), q.dtype)
    lse = np.empty((n, tq), q.dtype)

    def job(a, b):
        def run():
            sub = dataclasses.replace(spec, lead=(b - a,))
            _forward_unit(qf[a:b], kf[a // group:b // group], vf[a // group:b // group], sub, scale, group,
                          out[a:b], lse[a:b])
        return run

    with Workers(num_threads, n * tq * tk, DEFAULT) as w:
        w.run([job(a, b) for a, b in _units(n, tq, tk, group)])
    return out.reshape(lead + (tq, dv)), lse.reshape(lead + (tq,)), None


def backward(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int = 1, dlse=None,
             num_threads: int | None = None):
    """As :func:`reference.backward`: ``(dq (*L,Tq,D), dk (*Lk,Tk,D), dv (*Lk,Tk,Dv))``."""
    tq, tk = spec.tq, spec.tk
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    dof, of, lf = _flat(dout), _flat(out), lse.reshape(-1, tq)
    dlf = None if dlse is None else dlse.reshape(-1, tq)
    n = qf.shape[0]
    dq, dk, dv = np.empty(qf.shape, q.dtype), np.empty(kf.shape, q.dtype), np.empty(vf.shape, q.dtype)

    def job(a, b):
        def run():
            sub = dataclasses.replace(spec, lead=(b - a,))
            ka, kb = a // group, b // group
            dq[a:b], dk[ka:kb], dv[ka:kb] = _backward_unit(
                dof[a:b], qf[a:b], kf[ka:kb], vf[ka:kb], of[a:b], lf[a:b], sub, scale, group,
                None if dlf is None else dlf[a:b])
        return run

    with Workers(num_threads, n * tq * tk, DEFAULT) as w:
        w.run([job(a, b) for a, b in _units(n, tq, tk, group)])
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# --- one work unit: reference.py's equations and operation order, in place ------------------
# Each step rounds as reference.py's does (x * c, where, x - m, exp, x / t in the same order,
# written into the one score buffer instead of new arrays), so a unit gives the reference's bits.

def _masked_scores(q, k, spec: MaskSpec, scale: float) -> np.ndarray:
    """S = scale · Q Kᵀ, -inf where the query may not attend: ``(n, Tq, Tk)``, a new array."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))  # (n,Tq,D) @ (n,D,Tk) -> (n,Tq,Tk)
    s *= q.dtype.type(scale)
    ok = spec.allowed()                      # (Tq, Tk), the same for every head, or None
    if ok is not None:
        np.copyto(s, -np.inf, where=~ok)
    return s


def _forward_unit(q, k, v, spec: MaskSpec, scale: float, group: int, out, lse) -> None:
    """Rows of ``n`` stacked heads: ``out (n,Tq,Dv)`` and ``lse (n,Tq)`` written in place."""
    k, v = reference._expand_groups(k, group), reference._expand_groups(v, group)
    s = _masked_scores(q, k, spec, scale)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)         # a row that sees nothing: exp(-inf - 0) = 0
    s -= m
    np.exp(s, out=s)                         # e = exp(S - m)
    total = np.sum(s, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse[...] = (m + np.log(total))[..., 0]
    s /= np.where(total == 0, 1, total)      # P
    np.matmul(s, v, out=out)                 # (n,Tq,Tk) @ (n,Tk,Dv) -> (n,Tq,Dv)


def _backward_unit(dout, q, k, v, out, lse, spec: MaskSpec, scale: float, group: int, dlse):
    """``(dq (n,Tq,D), dk (n/G,Tk,D), dv (n/G,Tk,Dv))`` of ``n`` stacked heads."""
    kx, vx = reference._expand_groups(k, group), reference._expand_groups(v, group)
    p = _masked_scores(q, kx, spec, scale)
    p -= np.where(lse == -np.inf, 0, lse)[..., None]
    with np.errstate(over="ignore"):         # a row past 2^60 is done again below
        np.exp(p, out=p)                     # P = exp(S - lse)
    total = p.sum(axis=-1, keepdims=True)
    redo = reference.lse_off(total, lse[..., None])
    if redo.any():                           # rare: an lse an ulp off scores of 1e9 and more
        e, t = reference.own_max(_masked_scores(q, kx, spec, scale))
        np.copyto(p, e, where=redo)
        total = np.where(redo, t, total)
    p /= np.where(total > 0, total, 1)
    dv = np.matmul(np.swapaxes(p, -1, -2), dout)   # (n,Tk,Tq) @ (n,Tq,Dv) -> (n,Tk,Dv)
    ds = np.matmul(dout, np.swapaxes(vx, -1, -2))  # dP: (n,Tq,Dv) @ (n,Dv,Tk) -> (n,Tq,Tk)
    delta = np.sum(dout * out, axis=-1, keepdims=True)  # (n,Tq,1)
    if dlse is not None:                     # ∂lse_i/∂s_ij = P_ij
        delta = delta - dlse[..., None]
    ds -= delta
    ds *= p                                  # dS = P ∘ (dP - delta)
    sc = q.dtype.type(scale)
    dq = np.matmul(ds, kx) * sc              # (n,Tq,Tk) @ (n,Tk,D) -> (n,Tq,D)
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * sc  # (n,Tk,Tq) @ (n,Tq,D) -> (n,Tk,D)
    if group > 1:                            # sum the G query heads that shared each kv head
        dk = dk.reshape((-1, group) + dk.shape[-2:]).sum(axis=1)
        dv = dv.reshape((-1, group) + dv.shape[-2:]).sum(axis=1)
    return dq, dk, dv
