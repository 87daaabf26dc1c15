"""``qkv.torch.attention``: :func:`qkv.attention` on CPU tensors, differentiable in q, k and v."""
from __future__ import annotations

import torch

from ..errors import ShapeError
from . import ops, options as opt

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor (qkv.attention takes NumPy arrays); "
                             f"got {type(t).__name__}")
        opt.check_cpu(name, t)
        if t.dtype not in FLOATS:
            raise ShapeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor; got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ShapeError(f"{name} must have q's dtype {q.dtype}; got {t.dtype}")


def _plain_call(q, k, v, args: tuple) -> bool:
    """True where the forward operator would only run its CPU kernel and nothing would record
    it: no gradient wanted, plain tensors, nothing tracing, compiling, transforming, profiling
    or intercepting calls. Then the kernel runs directly, without the dispatcher's ~0.2 ms a
    call (measured inside a Llama forward); everywhere else the operator runs."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v) + args):
        return False
    C = torch._C
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))
            and not torch.compiler.is_compiling() and C._get_tracing_state() is None
            and C._len_torch_dispatch_stack() == 0 and not C._is_torch_function_mode_enabled()
            and C._functorch.peek_interpreter_stack() is None and not torch.autograd._profiler_enabled())


def autocast_inputs(q, k, v) -> tuple:
    """q, k and v as CPU autocast would hand them to SDPA, which is on its list of operators
    that run in the lower precision: each floating tensor but float64 cast to autocast's dtype
    (bfloat16 or float16) where ``torch.autocast("cpu")`` is on, as they came otherwise."""
    if not torch.is_autocast_enabled("cpu"):
        return q, k, v
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (q, k, v))


def attention(q, k, v, *, return_lse=False, return_weights=False, **options):
    """:func:`qkv.attention` on CPU tensors in SDPA's layout, with autograd and ``torch.compile``.

    Every keyword of :func:`qkv.attention` is accepted with qkv's meaning (``mask`` True =
    may attend, ``causal`` ``True``/``"top_left"``/``"bottom_right"``, ``window``,
    ``kv_lengths``, ``alibi``, ``scale``, ``gqa``, ``softcap``, ``dropout_p``, ``method``);
    mask, bias, kv_lengths and alibi may be tensors or arrays. With ``dropout_p > 0`` and no
    ``dropout_seed`` the seed is drawn from torch's generator (``torch.manual_seed`` repeats
    a run); the backward draws the same keep-mask from it. A query row that may attend to nothing gets output 0
    and gradient 0, never NaN. Gradients flow to ``q``, ``k`` and ``v`` (and through
    ``lse`` when it is returned), and to ``bias`` where it requires one (a learned bias,
    T5's relative positions: ``dS`` summed over its broadcast axes, as
    :func:`qkv.attention_backward` with ``return_dbias=True``); ``alibi`` is a constant, and
    the weights carry no gradient.

    Contiguous (or simply strided) float16/32/64 tensors reach qkv's kernels as NumPy views
    without a copy and the results come back without one. Where no gradient is wanted and
    nothing traces, compiles or records the call, the operator's kernel is called directly
    (the same kernel: the same bits, less per-call cost). float16 computes in float32 (as
    in qkv), bfloat16 is converted to float32 at the boundary (NumPy has no bfloat16) and
    the results are cast back; float64 computes in float64. Under ``torch.autocast("cpu")``
    q, k and v are first cast to autocast's dtype as SDPA's are (float64 excepted: RoPE
    models hand over float32 q, k and a bfloat16 v), so the output has that dtype and each
    gradient its input's own.

    Args:
        q: ``(..., Hq, Tq, D)``. k: ``(..., Hkv, Tk, D)``. v: ``(..., Hkv, Tk, Dv)``; CPU
            tensors of one float dtype.
        return_lse: also return ``lse (..., Hq, Tq)`` (float32, float64 for float64).
        return_weights: also return the weights ``(..., Hq, Tq, Tk)`` (no gradient).
        **options: the keywords of :func:`qkv.attention`.

    Returns:
        ``out (..., Hq, Tq, Dv)`` in q's dtype, then lse and weights if asked.

    Raises:
        qkv.ShapeError: a tensor not on the CPU, a bad shape, dtype or option.

    >>> import torch, qkv.torch
    >>> x = torch.tensor([[1., 0.], [0., 1.], [1., 1.]], requires_grad=True)
    >>> out = qkv.torch.attention(x, x, x)
    >>> out.detach().numpy().round(3)
    array([[0.802, 0.599],
           [0.599, 0.802],
           [0.752, 0.752]], dtype=float32)
    >>> out.sum().backward(); tuple(x.grad.shape)
    (3, 2)
    """
    try:
        q, k, v = autocast_inputs(q, k, v)
        _check_qkv(q, k, v)
        for name, flag in (("return_lse", return_lse), ("return_weights", return_weights)):
            if not isinstance(flag, bool):
                raise ShapeError(f"{name} must be True or False; got {flag!r}")
        args = opt.encode(options)
        if _plain_call(q, k, v, args):
            out, lse, seed = ops.fwd_kernel(q, k, v, *args, return_lse)
        else:  # without dropout_seed the forward draws one: torch.manual_seed repeats it, compiled or not
            out, lse, seed = ops.fwd(q, k, v, *args, return_lse)
        result = [out]
        if return_lse:
            result.append(lse)
        if return_weights:
            args = args[:ops.SEED] + (seed,) + args[ops.SEED + 1:]  # the forward's mask
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # a learned bias too
            result.append(ops.weights(q.detach(), k.detach(), v.detach(), *args))
    except ShapeError as err:
        raise ShapeError(str(err)) from None  # the caller's line, not our internals
    return result[0] if len(result) == 1 else tuple(result)
