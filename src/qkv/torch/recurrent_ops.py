"""qkv's recurrences (:mod:`qkv.recurrent`) as PyTorch operators, with autograd and fake kernels.

Two operators a recurrence, in the ``qkv`` namespace (``<inputs>`` are the recurrence's own
tensors: ``q, k, v, log_decay`` for the decay, ``q, k, v, beta, log_decay?`` for the delta
rule, ``q, k, v, a, b, log_decay`` for DPLR, ``x, log_a`` for the scan)::

    qkv::<name>_fwd(<inputs>, Tensor? initial_state, <options>) -> (out, final_state)
    qkv::<name>_bwd(Tensor dout, Tensor? dstate, <inputs>, Tensor? initial_state, <options>)
        -> (one gradient an input, dinitial_state)

with ``<options>`` ``float? scale, int? chunk_size`` (none for the scan). The kernels hand
NumPy views of the tensors to :func:`qkv.recurrent.decay_attention` (…) and
:func:`qkv.recurrent.decay_attention_backward` (…), which check every argument, and wrap
what comes back without a copy. The forward always returns the final state (the recurrence
holds it anyway), so one operator serves ``return_state`` both ways; ``register_autograd``
makes it differentiable in every tensor input, ``initial_state`` included.

**The gradient of the final state.** ``S_T`` is the last step's state, so a loss that uses it
adds ``dstate = ∂L/∂S_T`` to the gradient reaching ``S_T`` before the reverse loop starts
(the oracle's ``dS_T starts from dstate``); the backward operator hands it over as
``dstate=``, or None where the state was not used. An output that was not used has
gradient zero (``dout = 0``).

A gradient slot whose input was None (the delta rule's ``log_decay``, the initial state) is
an empty tensor in the backward operator's result (an operator returns a fixed number of
tensors) and None to autograd.

**Dtypes.** ``q, k, v`` (and dplr's ``a, b``) share one dtype, as torch's products require
(a mix is refused by name); the per-step gates may be wider. The output has the promoted dtype
of ``q, k, v`` (``x``, ``log_a`` for the scan); the state is float32 (float64 for float64), for every op.
bfloat16, which NumPy lacks, computes in float32 and is cast back; each gradient has its
input's dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import recurrent as rec
from ..errors import ShapeError, positive_int, reject_options
from ..options import parse_flag, parse_scale
from . import options as opt
from .functional import _plain_call

OPTIONS = (("scale", "float?"), ("chunk_size", "int?"))  # every recurrence's but the scan's


@dataclass(frozen=True)
class Recurrence:
    """One recurrence of :mod:`qkv.recurrent` and its two operators' schemas."""

    name: str                 # "decay_attention": qkv.recurrent.<name> and <name>_backward
    inputs: tuple             # its tensors in order; a name ending in "?" may be None
    options: tuple            # ((name, schema type), ...)
    out_from: int             # the input whose shape the output has (v; x)

    @property
    def forward(self) -> Callable:
        return getattr(rec, self.name)

    @property
    def backward(self) -> Callable:
        return getattr(rec, self.name + "_backward")

    @property
    def names(self) -> tuple:
        return tuple(n.rstrip("?") for n in self.inputs)

    def schema(self, backward: bool) -> str:
        tensors = [f"Tensor{'?' if n.endswith('?') else ''} {n.rstrip('?')}" for n in self.inputs]
        args = ["Tensor dout", "Tensor? dstate"] * backward + tensors + ["Tensor? initial_state"]
        args += [f"{kind} {name}" for name, kind in self.options]
        outs = ", ".join(["Tensor"] * (len(self.inputs) + 1 if backward else 2))
        return f"({', '.join(args)}) -> ({outs})"

    def out_dtype(self, tensors) -> torch.dtype:
        """The promoted dtype of q, k, v (x, log_a): the output's."""
        lead = tensors[:3] if self.options else tensors[:2]
        return functools.reduce(torch.promote_types, [t.dtype for t in lead])

    def state_dtype(self, out_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype, as :mod:`qkv.recurrent` returns it (the scan's too)."""
        return torch.float64 if out_dtype == torch.float64 else torch.float32

    def state_shape(self, tensors) -> tuple:
        if not self.options:
            x = tensors[0]
            return (x.shape[0], x.shape[2])   # (B, D)
        q, v = tensors[0], tensors[2]
        return (v.shape[0], v.shape[1], q.shape[3], v.shape[3])   # (B, H, Dk, Dv): v's heads (grouped: q's x G)


RECURRENCES = {r.name: r for r in (
    Recurrence("decay_attention", ("q", "k", "v", "log_decay"), OPTIONS, 2),
    Recurrence("delta_rule", ("q", "k", "v", "beta", "log_decay?"), OPTIONS, 2),
    Recurrence("dplr", ("q", "k", "v", "a", "b", "log_decay"), OPTIONS, 2),
    Recurrence("linear_scan", ("x", "log_a"), (), 0),
)}


def _numpy(t):
    return None if t is None else opt.to_numpy(t)


def _split(r: Recurrence, args: tuple) -> tuple:
    """``(tensors, initial_state, options dict)`` of a forward operator's arguments."""
    n = len(r.inputs)
    return args[:n], args[n], dict(zip((name for name, _ in r.options), args[n + 1:]))


# --- kernels: NumPy views in, qkv.recurrent, tensors out ---------------------------------

def forward_kernel(r: Recurrence, *args):
    """``(out, final_state)``: :func:`qkv.recurrent.<name>` on NumPy views of the tensors."""
    tensors, state, options = _split(r, args)
    out, final = r.forward(*map(_numpy, tensors), initial_state=_numpy(state), return_state=True, **options)
    dtype = r.out_dtype(tensors)
    return opt.from_numpy(out, dtype), opt.from_numpy(final, r.state_dtype(dtype))


def _backward_kernel(r: Recurrence, dout, dstate, *args):
    tensors, state, options = _split(r, args)
    grads = r.backward(_numpy(dout), *map(_numpy, tensors), initial_state=_numpy(state),
                       dstate=_numpy(dstate), **options)
    return _grads_as_tensors(grads, tensors + (state,), tensors[0])


def _grads_as_tensors(grads, inputs, first) -> tuple:
    """Each gradient as a tensor of its input's dtype; an empty one where the input was None."""
    return tuple(first.new_empty(0) if x is None else opt.from_numpy(g, x.dtype) for g, x in zip(grads, inputs))


def _forward_fake(r: Recurrence, *args):
    tensors, _, _ = _split(r, args)
    dtype = r.out_dtype(tensors)
    out = tensors[r.out_from].new_empty(tensors[r.out_from].shape, dtype=dtype)
    return out, out.new_empty(r.state_shape(tensors), dtype=r.state_dtype(dtype))


def _backward_fake(r: Recurrence, dout, dstate, *args):
    tensors, state, _ = _split(r, args)
    return tuple(tensors[0].new_empty(0) if x is None else x.new_empty(x.shape) for x in tensors + (state,))


# --- autograd: the forward's gradient is the backward operator ----------------------------

def _setup_context(r: Recurrence, ctx, inputs, output):
    n = len(r.inputs) + 1
    ctx.save_for_backward(*inputs[:n])
    ctx.options = tuple(inputs[n:])


def _backward(r: Recurrence, ctx, dout, dstate):
    saved = ctx.saved_tensors
    if dout is None:  # only the final state was used
        out_like = saved[r.out_from]
        dout = torch.zeros(out_like.shape, dtype=r.out_dtype(saved), device=out_like.device)
    grads = OPERATORS[r.name][1](dout, dstate, *saved, *ctx.options)
    return tuple(None if x is None else g for g, x in zip(grads, saved)) + (None,) * len(ctx.options)


def _define(r: Recurrence) -> tuple:
    """The forward and backward operators of ``r``, with fake kernels and autograd."""
    fwd = torch.library.custom_op(f"qkv::{r.name}_fwd", functools.partial(forward_kernel, r), mutates_args=(),
                                  schema=r.schema(backward=False))
    bwd = torch.library.custom_op(f"qkv::{r.name}_bwd", functools.partial(_backward_kernel, r), mutates_args=(),
                                  schema=r.schema(backward=True))
    fwd.register_fake(functools.partial(_forward_fake, r))
    bwd.register_fake(functools.partial(_backward_fake, r))
    fwd.register_autograd(functools.partial(_backward, r), setup_context=functools.partial(_setup_context, r))
    return fwd, bwd


OPERATORS = {name: _define(r) for name, r in RECURRENCES.items()}


# --- the calls ------------------------------------------------------------------------------

def call(name: str, tensors: tuple, initial_state, return_state, options: dict):
    """Run recurrence ``name`` on CPU tensors: the operator, or its kernel where nothing
    records the call (no gradient wanted, nothing tracing: :func:`qkv.torch.attention`'s rule).
    ``options`` are parsed by qkv's own parsers first (a schema takes typed values only)."""
    r = RECURRENCES[name]
    try:
        for n, t in zip(r.names + ("initial_state",), tensors + (initial_state,)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise ShapeError(f"{n} must be a torch.Tensor (qkv.recurrent.{name} takes NumPy arrays); "
                                 f"got {type(t).__name__}")
            if t is not None:
                opt.check_cpu(n, t)
        _same_dtype(r.names, tensors)
        return_state = parse_flag("return_state", return_state)
        args = tensors + (initial_state,) + tuple(_parse(k, options[k]) for k, _ in r.options)
        present = tuple(t for t in args if isinstance(t, torch.Tensor))   # x, log_a at least
        if _plain_call(present[0], present[1], present[-1], present):
            out, final = forward_kernel(r, *args)
        else:
            out, final = OPERATORS[name][0](*args)
    except ShapeError as err:
        raise type(err)(str(err)) from None  # the caller's line, not our internals
    return (out, final) if return_state else out


def _same_dtype(names: tuple, tensors: tuple) -> None:
    """The values a recurrence mixes (q, k, v and dplr's a, b; the scan's x) in one dtype, as
    torch's own products and ``scaled_dot_product_attention`` require: bfloat16 q beside
    float32 k is refused by name, not promoted. The per-step gates (``log_decay``, ``beta``,
    ``log_a``) may be wider, as transformers' models make them (float32 ``g`` beside bfloat16
    q, k, v), and the initial state is float32 by contract."""
    values = [(n, t) for n, t in zip(names, tensors) if n in ("q", "k", "v", "a", "b") and t is not None]
    for n, t in values[1:]:
        if t.dtype != values[0][1].dtype:
            raise ShapeError(f"{n} must have {values[0][0]}'s dtype {values[0][1].dtype} (torch's products "
                             f"do not mix dtypes); got {t.dtype}")


def _parse(name: str, value):
    if name == "scale":
        return parse_scale(value)
    return None if value is None else positive_int(name, value)


def decay_attention(q, k, v, log_decay, *, scale=None, initial_state=None, return_state=False, chunk_size=None,
                    **unknown):
    """:func:`qkv.recurrent.decay_attention` on CPU tensors, differentiable in q, k, v,
    log_decay and initial_state (and through the final state where it is returned).

    ``S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t`` (Mamba-2, GLA).
    q, k ``(B, H, T, Dk)``, v ``(B, H, T, Dv)``, log_decay ``(B, H, T)`` or ``(B, H, T, Dk)``,
    initial_state ``(B, H, Dk, Dv)``. Returns ``o (B, H, T, Dv)``, with ``return_state``
    ``(o, S_T)``. The checks and errors are :mod:`qkv.recurrent`'s.

    >>> import torch, qkv.torch
    >>> q = k = torch.ones(1, 1, 3, 1); v = torch.arange(1., 4.).reshape(1, 1, 3, 1)
    >>> qkv.torch.decay_attention(q, k, v, torch.full((1, 1, 3), 0.5).log(), scale=1.0).flatten()
    tensor([1.0000, 2.5000, 4.2500])
    """
    reject_options(decay_attention, unknown)
    return call("decay_attention", (q, k, v, log_decay), initial_state, return_state,
                dict(scale=scale, chunk_size=chunk_size))


def delta_rule(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None, return_state=False,
               chunk_size=None, **unknown):
    """:func:`qkv.recurrent.delta_rule` (DeltaNet; gated with ``log_decay``: Gated DeltaNet, or
    KDA with a decay a key channel) on CPU tensors, differentiable in every tensor input. beta
    ``(B, H, T)``, log_decay ``(B, H, T)``, ``(B, H, T, Dk)`` or None; the rest as
    :func:`decay_attention`. fla's signatures on it: :mod:`qkv.torch.hf_kernels`."""
    reject_options(delta_rule, unknown)
    return call("delta_rule", (q, k, v, beta, log_decay), initial_state, return_state,
                dict(scale=scale, chunk_size=chunk_size))


def dplr(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, return_state=False, chunk_size=None,
         **unknown):
    """:func:`qkv.recurrent.dplr` (RWKV-7's diagonal-plus-low-rank transition) on CPU tensors,
    differentiable in every tensor input. a, b ``(B, H, T, Dk)``; the rest as
    :func:`decay_attention`."""
    reject_options(dplr, unknown)
    return call("dplr", (q, k, v, a, b, log_decay), initial_state, return_state,
                dict(scale=scale, chunk_size=chunk_size))


def linear_scan(x, log_a, *, initial_state=None, return_state=False, **unknown):
    """:func:`qkv.recurrent.linear_scan`, ``h_t = exp(log_a_t) ∘ h_{t-1} + x_t`` (Griffin's
    RG-LRU), on CPU tensors ``(B, T, D)``, differentiable in x, log_a and initial_state
    ``(B, D)``. Returns ``h``, with ``return_state`` ``(h, h_T)``."""
    reject_options(linear_scan, unknown)
    return call("linear_scan", (x, log_a), initial_state, return_state, {})
