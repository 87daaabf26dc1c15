"""The delta rule in chunks (DeltaNet, Gated DeltaNet: Yang et al. 2024), the fast path of
:func:`qkv.recurrent.delta_rule`; the step loop :func:`qkv.recurrent.delta.naive.delta_forward`
is its oracle.

**The recurrence.** Per (batch, head), with ``S`` of shape ``(Dk, Dv)``::

    S'  = e^{g_t} S_{t-1}
    u_t = beta_t (v_t - S'ᵀ k_t)              the correction written at step t
    S_t = S' + k_t u_tᵀ                       = (I - beta_t k_t k_tᵀ) e^{g_t} S_{t-1} + beta_t k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

Each step's transition is a Householder-like ``I - beta k kᵀ`` times a decay: stepping
through them costs ``T`` rank-one updates of a ``Dk × Dv`` state, none of them a matrix
product. The chunked form turns a chunk of ``C`` steps into products of ``C``-row blocks.

**Unrolling a chunk.** Inside a chunk with start state ``S_0``, ``γ_t = g_1 + ... + g_t``::

    S_t = e^{γ_t} S_0 + Σ_{s <= t} e^{γ_t - γ_s} k_s u_sᵀ

so the corrections depend on each other only through earlier positions of the chunk::

    u_t = beta_t (v_t - e^{γ_t} S_0ᵀ k_t - Σ_{s < t} e^{γ_t - γ_s} (k_t·k_s) u_s)

In matrix form, ``(I + A) U = diag(beta) (V - diag(e^γ) K S_0)`` with the strictly lower
``A_ts = beta_t e^{γ_t - γ_s} (k_t·k_s)``. That is the UT transform: one triangular
inverse ``Tinv = (I + A)⁻¹`` a chunk (:func:`qkv.recurrent.delta.chunk_parts.unit_lower_inverse`)
turns the ``C`` sequential corrections into products::

    U = Tinv diag(beta) (V - diag(e^γ) K S_0)  = U0 - W S_0,
    U0 = Tinv diag(beta) V,   W = Tinv diag(beta e^γ) K

(the WY representation: the chunk's product of transitions is ``e^{γ_C} I - Kcᵀ W`` with
``Kc = diag(e^{γ_C - γ}) K``, a rank-``C`` update of the identity). Then::

    S_C = e^{γ_C} S_0 + Kcᵀ U
    O   = scale · (diag(e^γ) Q S_0 + P U),     P = (Q Kᵀ) ∘ D

with ``D_ts = e^{γ_t - γ_s}`` on and below the diagonal, zero above: the read of the
chunk's start state plus the masked in-chunk scores against the corrections.

**What runs where.** ``K Kᵀ``, ``Q Kᵀ`` (one product ``[K; Q] Kᵀ``), ``D``, ``A``, ``Tinv``
and ``P`` need no state: they are computed for every chunk at once. The state then passes
once a chunk, three products (:func:`qkv.recurrent.delta.chunk_parts.pass_states`)::

    [K S_n; Q S_n]  = [K_n; Q_n] S_n                       (2C,Dk) @ (Dk,Dv)
    U_n             = Tinv_n diag(beta) (V_n - diag(e^γ) K S_n)   (C,C) @ (C,Dv)
    S_{n+1}         = e^{γ_C} S_n + Kc_nᵀ U_n               (Dk,C) @ (C,Dv)

and the outputs ``O = scale · (diag(e^γ) Q S + P U)`` are one more batched product. With the
``fast`` extra, float32's pass is one compiled loop calling BLAS's ``sgemm`` chunk after chunk
(:func:`qkv.recurrent.delta.compiled.pass_chunks`), NumPy's bits without Python between chunks. Applying
``Tinv`` to ``V - ...`` in the pass, not precomputing ``U0`` and ``W``, saves the ``C²·Dk``
product of ``W`` (the backward needs no ``W`` either). Time ``O(T·C·D + T·D²)``, memory
``O(T·(C + D))`` (``(T/C)·Dk·Dv`` more in the backward, the chunk start states), never a
``(T, T)`` array. Heads are independent: they are split over qkv's threads
(:func:`by_heads`), BLAS held to one thread.

**Decays never overflow.** Only ``e^{γ_t - γ_s}`` with ``t >= s``, ``e^{γ_t}`` and
``e^{γ_C - γ_t}`` appear: every exponent is ``<= 0`` (``g <= 0``), so with ``g = -30`` a
step the products underflow to zero and nothing becomes inf or NaN; ``e^{-γ}`` is never
formed.

**Dtypes.** float32 inputs compute in float32 (every product a BLAS matmul), float64 in
float64; only the cumulative decays ``γ`` and their differences are formed in float64
(cheap: ``T·C`` numbers a head), since in float32 the difference of two long sums loses the
small steps (see :func:`qkv.recurrent.delta.chunk_parts.decays`). Measured float32 error against
float64: about that of the float32 step loop for the outputs (at most 1.5x), up to 4x for
the gradients (tests/recurrent/test_recurrent_delta.py holds 2x and 5x). A chunk of ``C = 1`` is the
step recurrence itself.

**Chunk size.** The in-chunk work grows with ``C`` (``C²·D`` a chunk, ``T·C·D`` in all),
the state's work does not (``T·D²``) but comes in ``T/C`` passes of smaller products.
Measured (float32, one thread, T = 2048, 8 heads): C = 32 and 64 within noise for the
forward, 64 about 15% faster than 32 for the backward at D = 128, and 128 slower than
both by 30-50%; hence ``CHUNK = 64``. The compiled float32 backward, whose state products
outnumber the forward's, takes 32 by default (:data:`qkv.recurrent.delta.backward.COMPILED_CHUNK`).

The backward (the same chunks, the state's gradient running back once a chunk) is derived
in :mod:`qkv.recurrent.delta.backward`.
"""
from __future__ import annotations

import numpy as np

from ... import threads
from . import backward as delta_backward, channels
from .chunk_parts import CHUNK, from_chunks, pass_states, prepare

__all__ = ["forward", "backward", "CHUNK"]

SERIAL_WORK = 1 << 18   # T·(C + Dk + Dv)·heads below which a call stays on the calling thread
GROUP_WORK = 1 << 22    # T·(C + Dk + Dv)·heads at most in one group of heads (memory, cache)


def start_state(q, v, initial_state):
    """``S_0 (B, HV, Dk, Dv)`` in q's dtype: the given state or zeros."""
    if initial_state is None:
        return np.zeros(v.shape[:2] + (q.shape[-1], v.shape[-1]), dtype=q.dtype)
    return np.asarray(initial_state, dtype=q.dtype)


def value_heads(x: np.ndarray, G: int) -> np.ndarray:
    """q or k ``(B, H, T, Dk)`` repeated to the ``H·G`` value heads they serve (each head ``G``
    times in a row, as ``repeat_interleave``); ``x`` itself where ``G = 1``."""
    return x if G == 1 else np.repeat(x, G, axis=1)


def by_heads(job, arrays: list, chunk: int, per_head: int | None = None) -> tuple:
    """``job(*arrays)`` over groups of (batch, head) pairs on qkv's threads, BLAS held to one
    thread meanwhile, and the outputs joined back (None stays None).

    Heads are independent and every product and sum here runs within one head, so a head's
    numbers do not depend on its group: the bits are the same on any thread count. Groups
    hold at most ``GROUP_WORK`` numbers of ``per_head`` a head (``T·(C + Dk + Dv)`` unless
    given), which bounds the memory of the ``(C, C)`` blocks however many heads come. q and k
    (``arrays[:2]``) may have fewer heads than v (grouped value heads): a group then holds
    whole key heads and the value heads they serve, unless there are fewer key heads than the
    threads would take (q and k are then repeated to the value heads: the same bits).
    """
    q = arrays[0]
    Hk, Dk = q.shape[1], q.shape[-1]
    B, H, T = arrays[2].shape[:3]
    if per_head is None:
        per_head = T * (min(chunk, T) + Dk + arrays[2].shape[-1])
    nt = min(threads.get_num_threads(), B * H) if B * H * per_head >= SERIAL_WORK else 1
    if B * Hk < nt:
        arrays = [value_heads(x, H // Hk) for x in arrays[:2]] + list(arrays[2:])
        Hk = H
    G = H // Hk
    groups = min(B * Hk, max(nt, -(-B * H * per_head // GROUP_WORK)))
    threads.hold_blas()
    try:
        if groups <= 1:
            return job(*arrays)
        flat = [None if x is None else x.reshape((1, -1) + x.shape[2:]) for x in arrays]
        cuts = np.linspace(0, B * Hk, groups + 1).astype(int)          # in key heads

        def run(a, b):
            return job(*[None if x is None else x[:, a:b] if i < 2 else x[:, a * G:b * G] for i, x in enumerate(flat)])
        if nt == 1:
            parts = [run(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
        else:
            parts = list(threads.pool(nt).map(run, cuts[:-1], cuts[1:]))
    finally:
        threads.release_blas()
    return tuple(None if out is None else np.concatenate([p[i] for p in parts], axis=1).reshape((B, H) + out.shape[2:])
                 for i, out in enumerate(parts[0]))


def _channel_chunk(chunk, q, v) -> tuple:
    """A decay a key channel (:mod:`.channels`): its chunk and the numbers a head holds (the NumPy path's
    decay blocks; the compiled path's chunk arrays, :func:`by_heads`' default)."""
    B, H, T, Dk = q.shape
    if (C := channels.compiled_chunk(chunk, q.dtype, T)) is not None:
        return C, None
    C = channels.chunk_size(chunk, T)
    return C, channels.work(T, C, Dk, v.shape[-1])


def forward(q, k, v, beta, g=None, *, scale, initial_state=None, chunk=None):
    """``(o (B, H, T, Dv), S_T (B, H, Dk, Dv))`` of the (gated) delta rule, in q's dtype.

    ``q, k (B, H, T, Dk)``, ``v (B, H, T, Dv)``, ``beta (B, H, T)``, ``g (B, H, T)`` (<= 0),
    ``(B, H, T, Dk)`` (a decay a key channel: :mod:`qkv.recurrent.delta.channels`) or None
    (no decay); ``chunk`` positions a chunk (None: ``CHUNK``, ``channels.CHUNK`` for a decay
    a key channel; at most T). Heads run on :func:`qkv.threads.get_num_threads` threads.
    v (and beta, g, the state) may have ``G`` times q's heads: a key head's ``[K; Q]`` and
    scores are then made once for its G value heads (:func:`.chunk_parts.prepare`).
    """
    o = np.empty(v.shape, q.dtype)                                      # the head groups write into it (no join)
    if g is not None and g.ndim == 4:                                   # a key channel's decays: each head its own
        q, k = value_heads(q, v.shape[1] // q.shape[1]), value_heads(k, v.shape[1] // q.shape[1])
        C, work = _channel_chunk(chunk, q, v)
        S = by_heads(lambda *xs: (channels.forward(*xs[:-1], scale=scale, chunk=chunk, out=xs[-1]),),
                     [q, k, v, beta, g, initial_state, o], C, work)
        return (o,) + S
    C = max(1, min(CHUNK if chunk is None else chunk, q.shape[2]))
    return (o,) + by_heads(lambda *xs: (_forward(*xs, scale=scale, chunk=C),), [q, k, v, beta, g, initial_state, o], C)


def backward(dout, dstate, q, k, v, beta, g=None, *, scale, initial_state=None, chunk=None):
    """``(dq, dk, dv, dbeta, dg, dinitial_state)`` of :func:`forward`, in q's dtype (``dg`` None
    without ``g``, ``dinitial_state`` None without ``initial_state``): see
    :mod:`qkv.recurrent.delta.backward` (its chunk: :func:`qkv.recurrent.delta.backward.chunk_size`).
    The head groups write their gradients into arrays made here (no join afterwards)."""
    G = v.shape[1] // q.shape[1]
    if G > 1:                                                           # grouped value heads: as repeated,
        grads = backward(dout, dstate, value_heads(q, G), value_heads(k, G), v, beta, g, scale=scale,
                         initial_state=initial_state, chunk=chunk)      # then each group's dq, dk summed
        return tuple(x.reshape(q.shape[:2] + (G,) + q.shape[2:]).sum(axis=2) for x in grads[:2]) + grads[2:]
    if g is not None and g.ndim == 4:
        C, work = _channel_chunk(chunk, q, v)

        def channel_job(q, k, v, beta, g, S0, dout, dstate):
            return channels.backward(dout, dstate, q, k, v, beta, g, S0, scale=scale, chunk=chunk)
        return by_heads(channel_job, [q, k, v, beta, g, initial_state, dout, dstate], C, work)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = delta_backward.chunk_size(chunk, q.dtype, T, Dk, Dv)
    out = delta_backward.empty_grads(q, k, v, beta, g)

    def job(q, k, v, beta, g, S0, dout, dstate, *out):                 # out: the group's heads of each gradient
        return delta_backward.backward(dout, dstate, q, k, v, beta, g, scale=scale, initial_state=S0, chunk=C,
                                       out=out)[-1:]
    per_head = T * (C + Dk + Dv) + -(-T // C) * Dk * Dv                # and the chunks' start states, kept
    return tuple(out) + by_heads(job, [q, k, v, beta, g, initial_state, dout, dstate, *out], C, per_head)


def _forward(q, k, v, beta, g, initial_state, out, *, scale, chunk):
    """The final state; the outputs written into ``out`` (a group's heads, C-ordered)."""
    ch = prepare(q, k, v, beta, g, chunk, keep=False)
    N, C = ch.v.shape[2:4]
    whole = out.reshape(out.shape[:2] + (N, C, out.shape[-1])) if N * C == ch.T and out.flags.c_contiguous else None
    run = pass_states(ch, start_state(q, v, initial_state), scale=scale, out=whole)   # (whole: a view it writes)
    if run.O is None:
        o = ch.P @ run.U                                             # (B,H,N,C,C) @ (B,H,N,C,Dv) -> (B,H,N,C,Dv)
        o += run.QS
        o *= scale
    else:                                                            # made in the compiled pass, the same bits
        o = run.O
    if o is not whole:
        out[...] = from_chunks(o, ch.T)
    return run.S
