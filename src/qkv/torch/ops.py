"""qkv's attention as PyTorch operators, with autograd, fake kernels and torch.compile.

Four operators in the ``qkv`` namespace (``<options>`` is the typed list of
:mod:`qkv.torch.options`, one or two arguments per keyword of :func:`qkv.attention`)::

    qkv::attention_fwd(q, k, v, <options>, bool return_lse) -> (out, lse, seed)
    qkv::attention_bwd(dout, q, k, v, out, lse, dlse?, <options>) -> (dq, dk, dv)
    qkv::attention_bwd_bias(dout, q, k, v, out, lse, dlse?, <options>) -> (dq, dk, dv, dbias)
    qkv::attention_weights(q, k, v, <options>) -> weights

**A dropout seed drawn in the graph.** With ``dropout_p > 0`` and no ``dropout_seed`` the
forward operator's kernel draws the seed from torch's default generator, as eager code draws
a dropout mask, and returns it (``seed``, a 0-d int64 tensor; the given seed, or 0 without
dropout, otherwise); the backward and the weights take it as their ``dropout_seed`` tensor.
So ``torch.compile(fullgraph=True)`` records one node that draws at each call, and the same
``torch.manual_seed`` gives the same mask compiled and eager (a seed drawn outside as a
Python int would be a data-dependent value in the graph, and inductor's own random numbers
differ from eager's). The operator is tagged ``nondeterministic_seeded``: no partitioner
recomputes it in the backward.

Each is a ``torch.library.custom_op`` whose kernel hands NumPy views of the tensors to
:func:`qkv.attention` / :func:`qkv.attention_backward` (no copy for contiguous or strided
float16/32/64 tensors; bfloat16 becomes float32) and wraps what comes back without a copy.
Each has a fake kernel (``register_fake``: shapes and dtypes only), so ``torch.compile``
and ``torch.export`` trace through it as one node. ``register_autograd`` makes the
forward differentiable in q, k and v by calling the backward operator, which is what
PyTorch's documentation asks for instead of an ``autograd.Function`` around opaque code; where
the bias requires a gradient (T5's learned relative positions) the backward is
``attention_bwd_bias``, :func:`qkv.attention_backward` with ``return_dbias=True``.

**The gradient of lse.** With ``return_lse=True`` the caller may use ``lse`` in the loss.
Since ``∂lse_i/∂s_ij = P_ij``, a gradient ``dlse_i`` adds ``P_ij · dlse_i`` to the
backward's ``dS_ij = P_ij (dP_ij - delta_i)``, where ``dP = dO Vᵀ`` and
``delta_i = rowsum(dO_i * O_i)``: the backward operator hands ``dlse`` to
:func:`qkv.attention_backward` (``dlse=``), whose kernels add it. (An extra value column
``[v, 1]`` with ``[o, 0]`` would carry it only if the kernel took delta from ``out``; the
tiled kernel takes it from P where a tile holds whole rows.)
"""
from __future__ import annotations

import math

import torch

from ..api import attention as np_attention, attention_backward as np_attention_backward
from ..errors import ShapeError, fmt_shape
from ..threads import one_thread_if
from . import options as opt

FWD = "qkv::attention_fwd"
BWD = "qkv::attention_bwd"
BWD_BIAS = "qkv::attention_bwd_bias"
WEIGHTS = "qkv::attention_weights"

FWD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {opt.SCHEMA_ARGS}, bool return_lse) -> (Tensor, Tensor, Tensor)"
BWD_SCHEMA = (f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {opt.SCHEMA_ARGS}) "
              "-> (Tensor, Tensor, Tensor)")
BWD_BIAS_SCHEMA = BWD_SCHEMA.replace("-> (Tensor, Tensor, Tensor)", "-> (Tensor, Tensor, Tensor, Tensor)")
WEIGHTS_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {opt.SCHEMA_ARGS}) -> Tensor"


BIAS = opt.position("bias")  # the bias tensor's index among the option arguments
SEED = opt.position("dropout_seed")  # the seed's


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- kernels: NumPy views in, qkv, tensors out ----------------------------------------------

# Up to this many score entries (B·H·Tq·Tk) qkv's kernels that run on Python threads (the
# tiled kernels, the row kernel without numba) stay on the calling thread while torch uses more
# than one thread. torch's OpenMP workers spin on after each of torch's operators (libgomp's
# wait policy) and hold the cores a kernel thread of qkv's would take: inside a Hugging Face
# model (width 128, B=4, 2 threads) qkv ÷ sdpa went from 1.10-1.21 threaded to 1.07-1.10 on the
# calling thread at T = 256, 0.94-1.00 from 0.96-1.04 at T = 512, 1.04-1.06 from 1.02-1.18 at
# T = 1024 (16·2^20 entries). Past it the kernel threads are worth it.
#
# The compiled row kernel (numba's own threads, one parallel loop a call) keeps its threads:
# on a Zen 5, `qkv bench --suite hf` models at T = 256 / 512 / 1024, qkv ÷ sdpa over the four
# rows, two runs, went from 0.97-1.10 / 0.89-1.00 / 0.91-1.02 on the calling thread to
# 0.90-1.00 / 0.79-0.87 / 0.72-0.82 threaded (AVX-512), and as AVX2 from 1.00-1.15 /
# 0.99-1.09 / 1.02-1.12 to 0.94-1.02 / 0.79-0.90 / 0.79-0.96.
TORCH_SERIAL_WORK = 1 << 24


def _threads(q, k):
    """``kernel_threads(1, pools_only=True)`` for a problem of at most :data:`TORCH_SERIAL_WORK`
    entries while torch's own threads are up; else the caller's setting."""
    return one_thread_if(torch.get_num_threads() > 1 and math.prod(q.shape[:-1]) * k.shape[-2] <= TORCH_SERIAL_WORK,
                         pools_only=True)


def fwd_kernel(q, k, v, *args):
    """The forward operator's CPU kernel: ``(out, lse, seed)`` for q, k, v and the option
    arguments, the dropout seed drawn from torch's generator where dropout wants one and none
    was given."""
    kwargs = opt.decode(args[:-1])
    if kwargs["dropout_p"] and kwargs["dropout_seed"] is None:
        kwargs["dropout_seed"] = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64))
    with _threads(q, k):
        out, lse = np_attention(opt.to_numpy(q), opt.to_numpy(k), opt.to_numpy(v), return_lse=True, **kwargs)
    seed = torch.tensor(opt.seed_value(kwargs["dropout_seed"]), dtype=torch.int64)
    return opt.from_numpy(out, q.dtype), opt.from_numpy(lse, _lse_dtype(q.dtype)), seed


def _grads(dout, q, k, v, out, lse, dlse, args: tuple, return_dbias: bool) -> tuple:
    """:func:`qkv.attention_backward` on the tensors: ``(dq, dk, dv)`` (and ``dbias``) as tensors."""
    kwargs = opt.decode(args)
    arrays = [opt.to_numpy(t) for t in (dout, q, k, v, out, lse)]
    dlse = None if dlse is None else opt.to_numpy(dlse.to(lse.dtype))
    with _threads(q, k):
        grads = np_attention_backward(*arrays, dlse=dlse, return_dbias=return_dbias, **kwargs)
    dtypes = (q.dtype, k.dtype, v.dtype) + ((args[BIAS].dtype,) if return_dbias else ())
    return tuple(opt.from_numpy(g, dtype) for g, dtype in zip(grads, dtypes))


def _bwd_kernel(dout, q, k, v, out, lse, dlse, *args):
    return _grads(dout, q, k, v, out, lse, dlse, args, False)


def _bwd_bias_kernel(dout, q, k, v, out, lse, dlse, *args):
    return _grads(dout, q, k, v, out, lse, dlse, args, True)


def _weights_kernel(q, k, v, *args):
    kwargs = opt.decode(args)
    with _threads(q, k):
        _, weights = np_attention(opt.to_numpy(q), opt.to_numpy(k), opt.to_numpy(v), return_weights=True, **kwargs)
    return opt.from_numpy(weights, q.dtype)


fwd = torch.library.custom_op(FWD, fwd_kernel, mutates_args=(), schema=FWD_SCHEMA,
                              tags=(torch.Tag.nondeterministic_seeded,))
bwd = torch.library.custom_op(BWD, _bwd_kernel, mutates_args=(), schema=BWD_SCHEMA)
bwd_bias = torch.library.custom_op(BWD_BIAS, _bwd_bias_kernel, mutates_args=(), schema=BWD_BIAS_SCHEMA)
weights = torch.library.custom_op(WEIGHTS, _weights_kernel, mutates_args=(), schema=WEIGHTS_SCHEMA)


# --- fake kernels: shapes and dtypes only ---------------------------------------------------

def out_lead(q, k, gqa: bool) -> tuple:
    """The output's leading shape ``(..., Hq)`` for q ``(..., Hq, Tq, D)`` and k."""
    if gqa and (q.ndim < 3 or k.ndim < 3):
        raise ShapeError(f"with gqa=True q and k need a head axis (..., H, T, D); got q {fmt_shape(q.shape)} "
                         f"and k {fmt_shape(k.shape)}")
    try:
        if gqa:
            return tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])) + (q.shape[-3],)
        return tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    except RuntimeError:
        raise ShapeError(f"the leading axes of q and k must broadcast; got q {fmt_shape(q.shape)} "
                         f"and k {fmt_shape(k.shape)}") from None


@fwd.register_fake
def _fwd_fake(q, k, v, *args):
    lead = out_lead(q, k, opt.option(args[:-1], "gqa"))
    out = q.new_empty(lead + (q.shape[-2], v.shape[-1]))
    return out, q.new_empty(lead + (q.shape[-2],), dtype=_lse_dtype(q.dtype)), q.new_empty((), dtype=torch.int64)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@bwd_bias.register_fake
def _bwd_bias_fake(dout, q, k, v, out, lse, dlse, *args):
    bias = args[BIAS]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), bias.new_empty(bias.shape)


@weights.register_fake
def _weights_fake(q, k, v, *args):
    lead = out_lead(q, k, opt.option(args, "gqa"))
    return q.new_empty(lead + (q.shape[-2], k.shape[-2]))


# --- autograd: the forward's gradient is the backward operator ------------------------------

def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    options, ctx.return_lse = tuple(args[:-1]), bool(args[-1])
    ctx.bias_grad = ctx.needs_input_grad[3 + BIAS]
    out, lse, seed = output
    options = options[:SEED] + (seed,) + options[SEED + 1:]  # the seed the forward drew (or was given)
    ctx.slots = tuple(i for i, a in enumerate(options) if isinstance(a, torch.Tensor))
    ctx.options = tuple(None if isinstance(a, torch.Tensor) else a for a in options)
    ctx.save_for_backward(q, k, v, out, lse, *(options[i] for i in ctx.slots))


def _backward(ctx, dout, dlse, dseed):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    options = list(ctx.options)
    for i, t in zip(ctx.slots, saved):
        options[i] = t
    if dout is None:
        dout = torch.zeros_like(out)
    dlse = dlse if ctx.return_lse else None
    grads = [None] * (len(options) + 1)   # each option argument's, and return_lse's
    if ctx.bias_grad:
        dq, dk, dv, grads[BIAS] = bwd_bias(dout, q, k, v, out, lse, dlse, *options)
    else:
        dq, dk, dv = bwd(dout, q, k, v, out, lse, dlse, *options)
    return (dq, dk, dv, *grads)


fwd.register_autograd(_backward, setup_context=_setup_context)
