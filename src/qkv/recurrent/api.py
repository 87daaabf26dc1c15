"""The checked entry points of :mod:`qkv.recurrent`: each checks its arguments (shapes,
dtypes, the decays' range), converts them to the compute dtype once, and calls its op's
chunked form (:mod:`.decay.chunk`, :mod:`.delta.chunk`, :mod:`.generalized_delta.chunk`,
:mod:`.scan.chunk`). The recurrences and their conventions: :mod:`qkv.recurrent`."""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..errors import OptionError, ShapeError, as_float_array, fmt_shape, positive_int, reject_options
from ..kernels.magnitudes import square_sum
from .decay import chunk as _decay
from .delta import chunk as _delta
from .generalized_delta import chunk as _dplr, stepwise as _dplr_steps
from .scan import chunk as _scan

__all__ = ["decay_attention", "decay_attention_backward", "delta_rule", "delta_rule_backward",
           "dplr", "dplr_backward", "linear_scan", "linear_scan_backward"]


def check_gate(name: str, x: np.ndarray) -> None:
    """The gates' values: ``log_decay`` finite and <= 0, ``beta`` finite; a ShapeError naming
    the first that is not (every other argument passes). Also read by qkv.torch's decoding step,
    which does not come through here."""
    if name == "log_decay" and not (np.isfinite(x).all() and (x <= 0).all()):
        bad = x[~(np.isfinite(x) & (x <= 0))].ravel()[0]
        raise ShapeError(f"log_decay must be finite and <= 0 (a decay exp(g) in (0, 1] each step); got {bad}")
    if name == "beta" and not np.isfinite(x).all():
        raise ShapeError(f"beta must be finite (a write strength, in (0, 1) in the layers); "
                         f"got {x[~np.isfinite(x)].ravel()[0]}")


class _Call:
    """Checked arrays of one call, in the compute dtype (float32 for float16 and float32 inputs)."""

    def __init__(self, where, q, k, v, per_step, state, dstate, scale, chunk_size, views=False):
        q = as_float_array("q", q)
        if q.ndim != 4:
            raise ShapeError(f"q must have shape (B, H, T, Dk); got {fmt_shape(q.shape)}")
        B, H, T, Dk = q.shape
        if Dk == 0:
            raise ShapeError(f"q and k must have Dk >= 1 (the key width; the scale is 1/sqrt(Dk)); "
                             f"got q {fmt_shape(q.shape)}")
        k, v = as_float_array("k", k), as_float_array("v", v)
        if k.shape != q.shape:
            raise ShapeError(f"k must have q's shape (B, H, T, Dk) = {fmt_shape(q.shape)}; got {fmt_shape(k.shape)}")
        if v.ndim != 4 or v.shape[:3] != (B, H, T):
            raise ShapeError(f"v must have shape (B, H, T, Dv) = {fmt_shape((B, H, T))[:-1]}, Dv); "
                             f"got {fmt_shape(v.shape)}")
        self.in_dtype = np.result_type(q, k, v)
        self.dtype = np.dtype(np.float64 if self.in_dtype == np.float64 else np.float32)
        self.state_shape = (B, H, Dk, v.shape[-1])
        self.q, self.k, self.v = ((_in_dtype(x, self.dtype) if views else np.ascontiguousarray(x, dtype=self.dtype))
                                  for x in (q, k, v))
        self.params = [self._param(name, x, shapes) for name, x, shapes in per_step]
        self.state = self._state("initial_state", state)
        self.dstate = self._state("dstate", dstate)
        self.scale = 1.0 / math.sqrt(Dk) if scale is None else float(scale)
        if not math.isfinite(self.scale):
            raise OptionError(f"scale must be a finite number or None (1/sqrt(Dk)); got {scale!r}")
        self.chunk = None if chunk_size is None else positive_int("chunk_size", chunk_size)
        self.stepwise = False   # set by plan(): an input is not finite
        self.where = where

    def _param(self, name, x, shapes):
        """A per-step argument: one of the allowed shapes ``{label: shape}``; ``None`` passes."""
        if x is None:
            if None in shapes:
                return None
            raise ShapeError(f"{name} is required")
        x = as_float_array(name, x)
        if x.shape not in [s for s in shapes.values() if s is not None]:
            want = " or ".join(f"{lab} = {fmt_shape(s)}" for lab, s in shapes.items() if s is not None)
            raise ShapeError(f"{name} must have shape {want}; got {fmt_shape(x.shape)}")
        x = np.ascontiguousarray(x, dtype=self.dtype)
        check_gate(name, x)
        return x

    def _state(self, name, s):
        if s is None:
            return None
        s = as_float_array(name, s)
        if s.shape != self.state_shape:
            raise ShapeError(f"{name} must have shape (B, H, Dk, Dv) = {fmt_shape(self.state_shape)}; "
                             f"got {fmt_shape(s.shape)}")
        return np.ascontiguousarray(s, dtype=self.dtype)

    def plan(self, *more):
        """``(chunk, errstate)``: the caller's chunk size, or 1 where an input holds a NaN or an inf,
        and the NumPy error state to run in (where the inputs are not finite, ``inf - inf`` and
        ``0 · inf`` are what the recurrence carries, not news: no warning, as for a NaN).

        A chunk's products mix its rows before the causal mask zeroes what a row may not
        see, and ``0 · NaN`` is NaN: a NaN in ``k_10`` would reach the outputs of rows 0-9 of
        its chunk (and, backwards, a NaN in ``q_10`` the key gradients of rows 11 on). Chunks
        of one step have no such products: the NaN reaches what the recurrence carries it
        to (later steps and the state; backwards, earlier steps), as the step loop does. Two
        reductions a array find it; finite inputs keep their chunk and their bits."""
        if _not_finite(self.q, self.k, self.v, self.state, self.dstate, *self.params, *more):
            self.stepwise = True
            return 1, np.errstate(invalid="ignore", over="ignore")
        return self.chunk, contextlib.nullcontext()

    def dout(self, dout):
        dout = as_float_array("dout", dout)
        if dout.shape != self.v.shape:
            raise ShapeError(f"dout must have the output's shape (B, H, T, Dv) = {fmt_shape(self.v.shape)}; "
                             f"got {fmt_shape(dout.shape)}")
        return np.ascontiguousarray(dout, dtype=self.dtype)

    def out(self, o):
        return o.astype(self.in_dtype, copy=False)

    @property
    def empty(self) -> bool:
        """Nothing to compute: T = 0 (no step to take; the chunked forms need one), or B, H or
        Dv = 0 (no output and no state to carry: every output and gradient is empty or zero)."""
        return 0 in (self.v.shape[0], self.v.shape[1], self.v.shape[2], self.v.shape[3])

    def empty_forward(self, return_state: bool):
        """``o`` (empty) and the final state = the initial state (zeros without one)."""
        o = self.out(np.empty(self.v.shape, self.dtype))
        S = np.zeros(self.state_shape, self.dtype) if self.state is None else self.state.copy()
        return (o, S) if return_state else o

    def empty_backward(self, dout, originals):
        """Nothing computed: zero gradients for the (empty) per-step inputs; ``dinitial_state = dstate``."""
        self.dout(dout)
        dS0 = np.zeros(self.state_shape, self.dtype) if self.dstate is None else self.dstate.copy()
        zeros = [None if x is None else np.zeros(np.shape(x), self.dtype) for x in originals[:-1]]
        return self.grads(zeros + [dS0], originals)

    def grads(self, grads, originals):
        """Each gradient in its input's dtype; ``None`` where the input was ``None``."""
        return tuple(None if g is None or x is None else np.asarray(g).astype(np.result_type(x), copy=False)
                     for g, x in zip(grads, originals))


def _checked(where, *args, **kwargs):
    try:
        return _Call(where, *args, **kwargs)
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals


def _shapes(q, per="head"):
    if np.ndim(q) != 4:   # before the per-step shapes are read off it
        raise ShapeError(f"q must have shape (B, H, T, Dk); got {fmt_shape(np.shape(q))}")
    B, H, T, Dk = np.shape(q)
    head, chan = (B, H, T), (B, H, T, Dk)
    return {"head": {"(B, H, T)": head}, "both": {"(B, H, T)": head, "(B, H, T, Dk)": chan},
            "chan": {"(B, H, T, Dk)": chan},
            "optional both": {"(B, H, T)": head, "(B, H, T, Dk)": chan, None: None}}[per]


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
        q, k: ``(B, H, T, Dk)`` (the layers L2-normalise k). v: ``(B, H, T, Dv)``.
        beta: ``(B, H, T)``, the write strength (a sigmoid, in (0, 1), in the layers).
        log_decay: finite and ``<= 0``: ``(B, H, T)`` (one decay a head, Gated DeltaNet),
            ``(B, H, T, Dk)`` (a decay a key channel, KDA), or None (no decay: DeltaNet).
        scale, initial_state, return_state, chunk_size: as :func:`decay_attention`.

    Returns:
        ``o (B, H, T, Dv)``; with ``return_state``, ``(o, S_T)``.
    """
    reject_options(delta_rule, unknown)
    c = _checked("delta_rule", q, k, v, [("beta", beta, _shapes(q, "head")),
                                         ("log_decay", log_decay, _shapes(q, "optional both"))],
                 initial_state, None, scale, chunk_size)
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
    c = _checked("delta_rule_backward", q, k, v, [("beta", beta, _shapes(q, "head")),
                                                  ("log_decay", log_decay, _shapes(q, "optional both"))],
                 initial_state, dstate, scale, chunk_size)
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


def _distinct(x: np.ndarray) -> np.ndarray:
    """``x`` without its broadcast axes (stride 0, cut to one entry): each number once."""
    return x[tuple(slice(0, 1) if st == 0 else slice(None) for st in x.strides)]


def _in_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` in ``dtype``, laid out as it came (a view where it has the dtype), a broadcast
    view still one: only its distinct numbers converted."""
    if x.dtype == dtype:
        return x
    return np.broadcast_to(_distinct(x).astype(dtype), x.shape)


def _not_finite(*arrays) -> bool:
    """Whether an array holds a NaN or an inf, no temporary: ``Σx²`` first (one pass, 0.35-0.6x
    the time of a min and a max; a NaN or inf entry makes it NaN or inf), the min and the max
    where that is not finite (finite entries may overflow it); each number once (a broadcast
    view's :func:`_distinct` numbers: Mamba-2's B and C shared by 16 heads)."""
    return any(x is not None and x.size and not math.isfinite(square_sum(d := _distinct(x)))
               and not (np.isfinite(d.min()) and np.isfinite(d.max())) for x in arrays)


def _quiet_if_not_finite(*arrays):
    """No RuntimeWarning for what a NaN or an inf input carries (as :meth:`_Call.plan`); the
    scan's products are one step's each, so its NaN reaches what the steps carry it to."""
    return np.errstate(invalid="ignore", over="ignore") if _not_finite(*arrays) else contextlib.nullcontext()


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
