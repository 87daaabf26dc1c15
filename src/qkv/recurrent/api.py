"""The checked entry points of :mod:`qkv.recurrent`: each checks its arguments (shapes,
dtypes, the decays' range: :mod:`.checked`), converts them to the compute dtype once, and
calls its op's chunked form (:mod:`.decay.chunk`, :mod:`.delta.chunk`,
:mod:`.generalized_delta.chunk`, :mod:`.scan.chunk`). The recurrences and their conventions:
:mod:`qkv.recurrent`."""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape, reject_options
from .checked import checked as _checked, quiet_if_not_finite as _quiet_if_not_finite, shapes as _shapes
from .decay import chunk as _decay
from .delta import chunk as _delta
from .generalized_delta import chunk as _dplr, stepwise as _dplr_steps
from .scan import chunk as _scan

__all__ = ["decay_attention", "decay_attention_backward", "delta_rule", "delta_rule_backward",
           "dplr", "dplr_backward", "linear_scan", "linear_scan_backward"]


def decay_attention(q, k, v, log_decay, *, scale=None, initial_state=None, return_state=False,
                    chunk_size=None, **unknown):
    """Linear attention with a decaying state: Mamba-2's SSD, RetNet, GLA, RWKV-6.

    ``S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``. Unrolled::

        o_t = scale · Σ_{s <= t} (q_t · (k_s ∘ exp(G_t - G_s))) v_s + scale · (q_t ∘ exp(G_t))ᵀ S_0

    with ``G_t = g_1 + ... + g_t``: causal attention whose weights are decayed, not softmaxed.

    Args:
        q, k: ``(B, H, T, Dk)``. v: ``(B, H, T, Dv)``. float16, float32 or float64.
        log_decay: ``g``, finite and ``<= 0``: ``(B, H, T)`` (one decay a head, Mamba-2's
            ``dt·A``) or ``(B, H, T, Dk)`` (a decay a key channel, GLA).
        scale: the read's factor, ``1/sqrt(Dk)`` by default (Mamba-2 uses 1).
        initial_state: ``(B, H, Dk, Dv)`` or None (zeros).
        return_state: also return the final state ``S_T``.
        chunk_size: rows a chunk of the chunked form (its default when None).

    Returns:
        ``o (B, H, T, Dv)`` in the inputs' dtype; with ``return_state``, ``(o, S_T)``, S_T in
        the compute dtype (float32 for float16 inputs).

    >>> import numpy as np, qkv.recurrent as rec
    >>> q = k = np.ones((1, 1, 3, 1)); v = np.arange(1., 4.).reshape(1, 1, 3, 1)
    >>> rec.decay_attention(q, k, v, np.log(np.full((1, 1, 3), 0.5)), scale=1.0).ravel()
    array([1.  , 2.5 , 4.25])
    """
    reject_options(decay_attention, unknown)
    c = _checked("decay_attention", q, k, v, [("log_decay", log_decay, _shapes(q, "both"))],
                 initial_state, None, scale, chunk_size, views=True)   # the forward reads q, k, v unit by unit
    if c.empty:
        return c.empty_forward(return_state)
    chunk, errstate = c.plan()
    with errstate:
        o, S = _decay.forward(c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state, chunk=chunk)
    return (c.out(o), S) if return_state else c.out(o)


def decay_attention_backward(dout, q, k, v, log_decay, *, scale=None, initial_state=None, dstate=None,
                             chunk_size=None, **unknown):
    """Gradients ``(dq, dk, dv, dlog_decay, dinitial_state)`` of :func:`decay_attention`.

    ``dout = ∂L/∂o``; ``dstate = ∂L/∂S_T`` where the final state was returned and used.
    ``dinitial_state`` is None when ``initial_state`` is. Each gradient has its input's
    shape and dtype.
    """
    reject_options(decay_attention_backward, unknown)
    c = _checked("decay_attention_backward", q, k, v, [("log_decay", log_decay, _shapes(q, "both"))],
                 initial_state, dstate, scale, chunk_size)
    if c.empty:
        return c.empty_backward(dout, (q, k, v, log_decay, initial_state))
    do = c.dout(dout)
    chunk, errstate = c.plan(do)
    with errstate:
        grads = _decay.backward(do, c.dstate, c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state,
                            chunk=chunk)
    return c.grads(grads, (q, k, v, log_decay, initial_state))


def delta_rule(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None, return_state=False,
               chunk_size=None, **unknown):
    """The delta rule (DeltaNet), gated with ``log_decay`` (Gated DeltaNet, Qwen3-Next; a decay a
    key channel: Kimi Delta Attention).

    ``S' = diag(exp g_t) S_{t-1}``, ``S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ``,
    ``o_t = scale · S_tᵀ q_t``: each step moves what the state returns for ``k_t`` a fraction
    ``beta_t`` of the way to ``v_t`` (with ``|k_t| = 1`` and ``beta_t = 1`` it overwrites it).

    Args:
        q, k: ``(B, H, T, Dk)`` (the layers L2-normalise k). v: ``(B, H, T, Dv)``, or
            ``(B, HV, T, Dv)`` with ``HV`` a multiple of ``H`` (grouped value heads, fla's
            layout: value head ``j`` reads q and k head ``j // (HV / H)``, as if q and k were
            ``repeat_interleave``-d to HV heads, the same bits without the copies); beta,
            log_decay, the states and the output then have HV heads, and the backward's dq, dk
            sum their group's.
        beta: ``(B, H, T)``, the write strength (a sigmoid, in (0, 1), in the layers).
        log_decay: finite and ``<= 0``: ``(B, H, T)`` (one decay a head, Gated DeltaNet),
            ``(B, H, T, Dk)`` (a decay a key channel, KDA), or None (no decay: DeltaNet).
        scale, initial_state, return_state, chunk_size: as :func:`decay_attention`.

    Returns:
        ``o (B, H, T, Dv)``; with ``return_state``, ``(o, S_T)``.
    """
    reject_options(delta_rule, unknown)
    c = _checked("delta_rule", q, k, v, [("beta", beta, _shapes(q, "head", v)),
                                         ("log_decay", log_decay, _shapes(q, "optional both", v))],
                 initial_state, None, scale, chunk_size, grouped=True)
    if c.empty:
        return c.empty_forward(return_state)
    chunk, errstate = c.plan()
    with errstate:
        o, S = _delta.forward(c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state, chunk=chunk)
    return (c.out(o), S) if return_state else c.out(o)


def delta_rule_backward(dout, q, k, v, beta, log_decay=None, *, scale=None, initial_state=None, dstate=None,
                        chunk_size=None, **unknown):
    """Gradients ``(dq, dk, dv, dbeta, dlog_decay, dinitial_state)`` of :func:`delta_rule`
    (``dlog_decay`` None when ``log_decay`` is, ``dinitial_state`` when ``initial_state`` is)."""
    reject_options(delta_rule_backward, unknown)
    c = _checked("delta_rule_backward", q, k, v, [("beta", beta, _shapes(q, "head", v)),
                                                  ("log_decay", log_decay, _shapes(q, "optional both", v))],
                 initial_state, dstate, scale, chunk_size, grouped=True)
    if c.empty:
        return c.empty_backward(dout, (q, k, v, beta, log_decay, initial_state))
    do = c.dout(dout)
    chunk, errstate = c.plan(do)
    with errstate:
        grads = _delta.backward(do, c.dstate, c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state,
                            chunk=chunk)
    return c.grads(grads, (q, k, v, beta, log_decay, initial_state))


def dplr(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, return_state=False,
         chunk_size=None, **unknown):
    """The diagonal-plus-low-rank recurrence of RWKV-7 (the generalized delta rule).

    ``S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.
    RWKV-7 takes ``a = -κ̂`` and ``b = κ̂ ∘ α`` (a normalised removal key and its in-context
    learning rate): with ``g = 0`` and ``b = -β a`` this is the delta rule's transition
    ``I - β k kᵀ``.

    Args:
        q, k, a, b: ``(B, H, T, Dk)``. v: ``(B, H, T, Dv)``.
        log_decay: ``(B, H, T, Dk)`` or ``(B, H, T)``, finite and ``<= 0``.
        scale, initial_state, return_state, chunk_size: as :func:`decay_attention`.

    Returns:
        ``o (B, H, T, Dv)``; with ``return_state``, ``(o, S_T)``.
    """
    reject_options(dplr, unknown)
    c = _checked("dplr", q, k, v, [("a", a, _shapes(q, "chan")), ("b", b, _shapes(q, "chan")),
                                   ("log_decay", log_decay, _shapes(q, "both"))],
                 initial_state, None, scale, chunk_size)
    if c.empty:
        return c.empty_forward(return_state)
    chunk, errstate = c.plan()
    with errstate:
        impl = _dplr_steps if c.stepwise else _dplr   # a NaN: the chunked form's products would spread it
        o, S = impl.forward(c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state, chunk=chunk)
    return (c.out(o), S) if return_state else c.out(o)


def dplr_backward(dout, q, k, v, a, b, log_decay, *, scale=None, initial_state=None, dstate=None,
                  chunk_size=None, **unknown):
    """Gradients ``(dq, dk, dv, da, db, dlog_decay, dinitial_state)`` of :func:`dplr`."""
    reject_options(dplr_backward, unknown)
    c = _checked("dplr_backward", q, k, v, [("a", a, _shapes(q, "chan")), ("b", b, _shapes(q, "chan")),
                                            ("log_decay", log_decay, _shapes(q, "both"))],
                 initial_state, dstate, scale, chunk_size)
    if c.empty:
        return c.empty_backward(dout, (q, k, v, a, b, log_decay, initial_state))
    do = c.dout(dout)
    chunk, errstate = c.plan(do)
    with errstate:
        impl = _dplr_steps if c.stepwise else _dplr
        grads = impl.backward(do, c.dstate, c.q, c.k, c.v, *c.params, scale=c.scale, initial_state=c.state,
                            chunk=chunk)
    return c.grads(grads, (q, k, v, a, b, log_decay, initial_state))


def linear_scan(x, log_a, *, initial_state=None, return_state=False, **unknown):
    """The diagonal linear recurrence ``h_t = exp(log_a_t) ∘ h_{t-1} + x_t`` (Griffin's RG-LRU).

    Args:
        x, log_a: ``(B, T, D)``; ``log_a`` finite and ``<= 0``.
        initial_state: ``(B, D)`` or None (zeros).
        return_state: also return ``h_T``.

    Returns:
        ``h (B, T, D)`` in x's dtype; with ``return_state``, ``(h, h_T)``, h_T in the compute
        dtype (float32 for float16 inputs, as :func:`decay_attention`).
    """
    reject_options(linear_scan, unknown)
    x2, la, h0 = _scan_checked(x, log_a, initial_state, None)[:3]
    with _quiet_if_not_finite(x2, h0):
        h, hT = _scan.forward(x2, la, initial_state=h0)
    h = h.astype(np.result_type(x), copy=False)
    return (h, hT) if return_state else h


def linear_scan_backward(dh, x, log_a, *, initial_state=None, dstate=None, **unknown):
    """Gradients ``(dx, dlog_a, dinitial_state)`` of :func:`linear_scan`."""
    reject_options(linear_scan_backward, unknown)
    x2, la, h0, ds = _scan_checked(x, log_a, initial_state, dstate)
    dh = as_float_array("dh", dh)
    if dh.shape != x2.shape:
        raise ShapeError(f"dh must have x's shape (B, T, D) = {fmt_shape(x2.shape)}; got {fmt_shape(dh.shape)}")
    dh = np.ascontiguousarray(dh, dtype=x2.dtype)
    with _quiet_if_not_finite(x2, h0, ds, dh):
        dx, dla, dh0 = _scan.backward(dh, ds, x2, la, initial_state=h0)
    return (dx.astype(np.result_type(x), copy=False), dla.astype(np.result_type(log_a), copy=False),
            None if initial_state is None else dh0.astype(np.result_type(initial_state), copy=False))


def _scan_checked(x, log_a, h0, dstate):
    x, log_a = as_float_array("x", x), as_float_array("log_a", log_a)
    if x.ndim != 3:
        raise ShapeError(f"x must have shape (B, T, D); got {fmt_shape(x.shape)}")
    if log_a.shape != x.shape:
        raise ShapeError(f"log_a must have x's shape (B, T, D) = {fmt_shape(x.shape)}; got {fmt_shape(log_a.shape)}")
    ok = np.isfinite(log_a) & (log_a <= 0)
    if not ok.all():
        raise ShapeError(f"log_a must be finite and <= 0 (a decay exp(log_a) in (0, 1] each step); "
                         f"got {log_a[~ok].ravel()[0]}")
    dtype = np.float64 if np.result_type(x, log_a) == np.float64 else np.float32   # as the other ops
    out = [np.ascontiguousarray(x, dtype=dtype), np.ascontiguousarray(log_a, dtype=dtype)]
    for name, s in (("initial_state", h0), ("dstate", dstate)):
        if s is not None:
            s = as_float_array(name, s)
            if s.shape != (x.shape[0], x.shape[2]):
                raise ShapeError(f"{name} must have shape (B, D) = {fmt_shape((x.shape[0], x.shape[2]))}; "
                                 f"got {fmt_shape(s.shape)}")
            s = np.ascontiguousarray(s, dtype=dtype)
        out.append(s)
    return out
