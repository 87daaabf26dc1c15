"""flash-linear-attention's delta-rule kernels under their own names and signatures, on qkv's
delta rule (:func:`qkv.torch.delta_rule`: exact, differentiable in every tensor, CPU).

transformers (5.x) calls these through ``use_kernel_func_from_hub_with_fallback(name, "fla")``
in Qwen3-Next, OLMo-Hybrid (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``)
and Kimi Linear (``chunk_kda``, ``fused_recurrent_kda``); each function here takes fla 0.6's
arguments in fla's order with fla's defaults and layouts and returns ``(o, final_state)``.

**The recurrence** (a value head, ``S (K, V)``; Gated DeltaNet's ``g`` is one number a step,
KDA's a vector of K)::

    S' = diag(exp g_t) S_{t-1},   S_t = S' + k_t (beta_t (v_t - S'ᵀ k_t))ᵀ,   o_t = scale · S_tᵀ q_t

``scale`` None is ``K**-0.5``. The ``chunk_`` and ``fused_recurrent_`` functions compute the
same thing here (fla's differ in how, not what): both run qkv's chunked form, exact against
the step loop, with autograd for q, k, v, g, beta, the initial state and, where the gate is
computed inside (``use_gate_in_kernel``), ``A_log`` and ``dt_bias``.

**What the options do**, as in fla:

* ``use_qk_l2norm_in_kernel``: q and k each divided by ``sqrt(Σ x² + 1e-6)`` first (differentiably).
* ``cu_seqlens`` (``N+1`` int offsets, ``B = 1``): ``N`` packed sequences, the state reset at each
  boundary: each runs alone from ``initial_state[n]`` (zeros without one) and ``final_state[n]``
  is its end state; ``cu_seqlens_cpu`` and ``chunk_indices`` are fla's precomputed copies of it.
* grouped value heads: ``v (B, T, HV, V)`` with ``HV`` a multiple of q's ``H``; q and k head h
  serve value heads ``h·HV/H`` on.
* ``use_gate_in_kernel``: ``g`` is the raw gate: ``-exp(A_log) · softplus(g + dt_bias)`` (KDA with
  ``lower_bound``: ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))``);
  ``use_beta_sigmoid_in_kernel``: beta is a logit (``2·sigmoid`` with ``allow_neg_eigval``);
  ``state_v_first``: states are ``(N, HV, V, K)``.
* Dtypes: bfloat16 and float16 compute in float32 (as fla's kernels and transformers'
  fallbacks do); the output has v's dtype, the final state is float32 (float64 for float64).
* What changes fla's speed or memory only (``chunk_size`` in fla's allowed values,
  ``disable_recompute``, ``use_graph``, ``max_num_seqs``, ``safe_gate`` with gates already
  bounded) is accepted and has no effect; other keywords are ignored, as fla ignores them
  (transformers passes its layers' ``**kwargs`` on).

**Refused by name** (:class:`qkv.OptionError`): ``cp_context`` (context parallelism across
devices), ``return_intermediate_states``, ``gv`` (a decay a value channel), a beta a value
channel (``(B, T, HV, V)``), ``head_first`` (removed from fla).
"""
from __future__ import annotations

import torch

from . import decode
from ..recurrent_ops import delta_rule
from .fla_args import (Heads, beta_of, check_gates, gdn_gate, heads, kda_gate, kernel_heads, l2norm,
                       offsets, refuse, state_in)
from ...errors import OptionError

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"]


def _options(where: str, state_v_first: bool, kwargs: dict, chunk_sizes: tuple = ()) -> bool:
    """fla's keyword-only extras: ``transpose_state_layout`` (the old name of state_v_first),
    ``head_first`` (refused) and ``chunk_size`` (checked as fla does); the state layout."""
    if "head_first" in kwargs:
        refuse(where, "head_first", kwargs["head_first"], "removed from fla: inputs are (B, T, H, ...)")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise OptionError(f"{where}: state_v_first and its old name transpose_state_layout both given")
        state_v_first = bool(kwargs["transpose_state_layout"])
    if chunk_sizes and kwargs.get("chunk_size", chunk_sizes[-1]) not in chunk_sizes:
        raise OptionError(f"{where}: chunk_size must be one of {chunk_sizes} (fla's); got {kwargs['chunk_size']!r}")
    return bool(state_v_first)


def _run(where: str, n: Heads, q, k, v, g, beta, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, state_v_first, cu_seqlens):
    """The delta rule on fla's layout: ``(o (B, T, HV, V), final_state or None)``."""
    spans = offsets(where, cu_seqlens, n)
    S0 = state_in("initial_state", initial_state, n.B if spans is None else len(spans), n, state_v_first)
    out_dtype = v.dtype
    if spans is None and n.T == 1 and not _wants_grad(q, k, v, g, beta, S0):
        o, S = decode.step(q, k, v, beta, g, n.K ** -0.5 if scale is None else scale, S0, use_qk_l2norm_in_kernel)
        o = o.to(out_dtype)                                # a decoding step (qkv.torch.hf_kernels.decode)
        return (o, (S.transpose(-1, -2) if state_v_first else S) if output_final_state else None)
    if q.dtype in (torch.bfloat16, torch.float16):          # fla's kernels compute in float32
        q, k, v = q.float(), k.float(), v.float()
    if not _wants_grad(q, k):                               # normalised, in qkv's layout, in one pass
        q, k = (kernel_heads(x, n.H, use_qk_l2norm_in_kernel) for x in (q, k))
    else:
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        q, k = (x.transpose(1, 2) for x in (q, k))          # (B, T, H, K) -> (B, H, T, K)
    v = v.transpose(1, 2)                                   # (B, T, HV, V) -> (B, HV, T, V): grouped value heads
    #                                                         read q, k head h // (HV / H) (qkv.recurrent.delta_rule)
    beta = beta.transpose(1, 2)
    g = None if g is None else g.transpose(1, 2)
    scale = n.K ** -0.5 if scale is None else scale
    if spans is None:
        o, S = delta_rule(q, k, v, beta, g, scale=scale, initial_state=S0, return_state=True)
    else:
        outs, states = [], []
        for i, (a, b) in enumerate(spans):                  # each packed sequence alone: the state reset
            o_i, S_i = delta_rule(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b],
                                  None if g is None else g[:, :, a:b], scale=scale,
                                  initial_state=None if S0 is None else S0[i:i + 1], return_state=True)
            outs.append(o_i)
            states.append(S_i)
        o, S = torch.cat(outs, dim=2), torch.cat(states, dim=0)
    o = o.transpose(1, 2).to(out_dtype)
    if not output_final_state:
        return o, None
    return o, (S.transpose(-1, -2) if state_v_first else S)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """fla's ``chunk_gated_delta_rule`` (Gated DeltaNet: Qwen3-Next, OLMo-Hybrid).

    Args:
        q, k: ``(B, T, H, K)``. v: ``(B, T, HV, V)``, ``HV`` a multiple of H.
        g: ``(B, T, HV)`` log decays (``<= 0``), or the raw gate with ``use_gate_in_kernel=True``
            (keywords ``A_log``, ``dt_bias`` of ``(HV,)``).
        beta: ``(B, T, HV)``.
        scale, initial_state ``(N, HV, K, V)``, output_final_state, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens: the module docstring.

    Returns:
        ``(o (B, T, HV, V), final_state (N, HV, K, V) or None)``.
    """
    where = "chunk_gated_delta_rule"
    state_v_first = _options(where, state_v_first, kwargs, (16, 32, 64))
    if cp_context is not None:
        refuse(where, "cp_context", type(cp_context).__name__, "context parallelism across devices")
    n = heads(where, q, k, v)
    if g is None:
        raise OptionError(f"{where}: g (B, T, HV) is required; got None")
    check_gates(n, beta, g, "head")
    if kwargs.get("use_gate_in_kernel", False):
        if kwargs.get("A_log") is None:
            raise OptionError(f"{where}: use_gate_in_kernel=True needs A_log (HV,); got None")
        g = gdn_gate(g, kwargs["A_log"], kwargs.get("dt_bias"))
    beta = beta_of(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, where)
    return _run(where, n, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                     state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's ``fused_recurrent_gated_delta_rule`` (transformers' decoding path).

    ``g (B, T, HV)`` a head's log decay, ``gk (B, T, HV, K)`` a key channel's (both: their sum),
    neither: no decay (DeltaNet); ``beta`` None is ones; the rest as :func:`chunk_gated_delta_rule`
    (``use_gate_in_kernel``, ``A_log``, ``dt_bias`` are arguments here). ``gv`` is refused.
    """
    where = "fused_recurrent_gated_delta_rule"
    state_v_first = _options(where, state_v_first, kwargs)
    if gv is not None:
        refuse(where, "gv", f"tensor of shape {tuple(gv.shape)}", "a decay a value channel")
    n = heads(where, q, k, v)
    if beta is None:
        beta = torch.ones(n.B, n.T, n.HV, dtype=q.dtype)
    check_gates(n, beta, g, "head")
    if gk is not None:
        check_gates(n, beta, gk, "channel")
    if use_gate_in_kernel:
        if A_log is None or g is None:
            raise OptionError(f"{where}: use_gate_in_kernel=True needs g (the raw gate) and A_log (HV,); "
                              f"got g={None if g is None else 'tensor'}, A_log={None if A_log is None else 'tensor'}")
        g = gdn_gate(g, A_log, dt_bias)
    if gk is not None:
        g = gk if g is None else g[..., None] + gk
    beta = beta_of(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, where)
    return _run(where, n, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens)


def _kda_gate(where, n, g, A_log, dt_bias, use_gate_in_kernel, lower_bound, safe_gate):
    """KDA's decay: g as given, or computed from the raw gate (fla's checks first)."""
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise OptionError(f"{where}: safe_gate=True with use_gate_in_kernel=True needs lower_bound; got None")
        if not -5 <= lower_bound < 0:
            raise OptionError(f"{where}: lower_bound must be in fla's safe range [-5, 0); got {lower_bound!r}")
    if not use_gate_in_kernel:
        return g
    if A_log is None and lower_bound is None:
        raise OptionError(f"{where}: use_gate_in_kernel=True needs A_log (HV,) or lower_bound; got neither")
    return kda_gate(g, A_log, dt_bias, lower_bound)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """fla's ``chunk_kda`` (Kimi Delta Attention: Kimi Linear): the delta rule with a decay a key
    channel, ``g (B, T, HV, K)`` (log decays, or the raw gate with ``use_gate_in_kernel``:
    keywords ``A_log (HV,)``, ``dt_bias (HV·K,)``, and ``lower_bound``). The rest as
    :func:`chunk_gated_delta_rule`; ``return_intermediate_states`` and ``cp_context`` are refused.

    Returns:
        ``(o (B, T, HV, V), final_state (N, HV, K, V) or None)``.
    """
    where = "chunk_kda"
    state_v_first = _options(where, state_v_first, kwargs, (32, 64))
    if cp_context is not None:
        refuse(where, "cp_context", type(cp_context).__name__, "context parallelism across devices")
    if return_intermediate_states:
        refuse(where, "return_intermediate_states", True, "every chunk's state, for inference engines")
    n = heads(where, q, k, v)
    check_gates(n, beta, g, "channel")
    g = _kda_gate(where, n, g, kwargs.get("A_log"), kwargs.get("dt_bias"), use_gate_in_kernel, lower_bound, safe_gate)
    beta = beta_of(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, where)
    return _run(where, n, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's ``fused_recurrent_kda`` (Kimi Linear's decoding path): as :func:`chunk_kda`, with
    ``A_log``, ``dt_bias`` and ``lower_bound`` as arguments. A beta a value channel
    (``(B, T, HV, V)``, which fla's kernel takes) is refused by its shape."""
    where = "fused_recurrent_kda"
    state_v_first = _options(where, state_v_first, kwargs)
    n = heads(where, q, k, v)
    if isinstance(beta, torch.Tensor) and beta.dim() == 4:
        refuse(where, "beta", f"tensor of shape {tuple(beta.shape)}", "a write strength a value channel")
    check_gates(n, beta, g, "channel")
    g = _kda_gate(where, n, g, A_log, dt_bias, use_gate_in_kernel, lower_bound, False)
    beta = beta_of(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, where)
    return _run(where, n, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens)
