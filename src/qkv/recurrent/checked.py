"""The checked arrays of one call of :mod:`qkv.recurrent`: shapes and dtypes checked and
named, the per-step gates' range, the compute dtype (float32 for float16 and float32 inputs),
and whether an input holds a NaN or an inf (the calls then run in chunks of one step)."""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..errors import OptionError, ShapeError, as_float_array, fmt_shape, positive_int
from ..kernels.magnitudes import square_sum


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

    def __init__(self, where, q, k, v, per_step, state, dstate, scale, chunk_size, views=False, grouped=False):
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
        if grouped and v.ndim == 4 and (v.shape[0], v.shape[2]) == (B, T) and _groups(H, v.shape[1]):
            H = v.shape[1]                  # value heads: each group of HV / H reads one key head
        elif v.ndim != 4 or v.shape[:3] != (B, H, T):
            more = " or HV value heads, a multiple of H (each group of HV / H reads one key head)" if grouped else ""
            raise ShapeError(f"v must have shape (B, H, T, Dv) = {fmt_shape((B, H, T))[:-1]}, Dv){more}; "
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


def checked(where, *args, **kwargs):
    try:
        return _Call(where, *args, **kwargs)
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals


def _groups(H: int, HV: int) -> bool:
    """Whether ``HV`` value heads split into groups of whole key heads (``H`` of them)."""
    return HV % H == 0 if H else HV == 0


def shapes(q, per="head", v=None):
    """The per-step arguments' allowed shapes, ``{label: shape}``, q's heads or, given ``v``
    (the delta rule's grouped value heads), v's."""
    if np.ndim(q) != 4:   # before the per-step shapes are read off it
        raise ShapeError(f"q must have shape (B, H, T, Dk); got {fmt_shape(np.shape(q))}")
    B, H, T, Dk = np.shape(q)
    if v is not None and np.ndim(v) == 4 and _groups(H, np.shape(v)[1]):
        H = np.shape(v)[1]
    head, chan = (B, H, T), (B, H, T, Dk)
    return {"head": {"(B, H, T)": head}, "both": {"(B, H, T)": head, "(B, H, T, Dk)": chan},
            "chan": {"(B, H, T, Dk)": chan},
            "optional both": {"(B, H, T)": head, "(B, H, T, Dk)": chan, None: None}}[per]


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


def quiet_if_not_finite(*arrays):
    """No RuntimeWarning for what a NaN or an inf input carries (as :meth:`_Call.plan`); the
    scan's products are one step's each, so its NaN reaches what the steps carry it to."""
    return np.errstate(invalid="ignore", over="ignore") if _not_finite(*arrays) else contextlib.nullcontext()
