"""Attention's recurrent relatives: the decayed, delta-rule and DPLR recurrences of Mamba-2,
GLA, Gated DeltaNet and RWKV-7, and Griffin's diagonal scan, with their backwards.

Layout ``(B, H, T, D)`` as :func:`qkv.attention`. Each (batch, head) keeps a state ``S`` of
shape ``(Dk, Dv)``, written by the keys and values and read by the queries::

    decay_attention  S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ
    delta_rule       S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}ᵀ k_t))ᵀ
    dplr             S_t = (diag(exp g_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ
                     o_t = scale · S_tᵀ q_t

the conventions of flash-linear-attention's reference functions (``naive_recurrent_gla``,
``delta_rule_recurrence``, ``dplr_recurrence``), so code moves between the two. Unrolled,
``decay_attention`` is causal attention without a softmax, whose score ``q_t·k_s`` is
damped by the decays between s and t; the delta rule writes ``v_t`` over what the state
already held for ``k_t`` (a step of online regression), which is what lets it recall.

**One folder an op** (as flash-linear-attention's ``fla/ops/<name>/``): each holds its
chunked form, its compiled passes, its backward and its step-by-step float64 oracle side by
side, and one test holds the oracle and the fast path equal:

============================  ==============================================================
:mod:`.decay`                 ``decay_attention`` (Mamba-2, GLA): ``chunk``, ``intra`` (the
                              in-chunk products), ``fused`` and ``compiled`` (numba), ``naive``
:mod:`.delta`                 ``delta_rule`` (Gated DeltaNet): ``chunk``, ``chunk_parts``,
                              ``backward``, ``compiled``, ``naive``
:mod:`.generalized_delta`     ``dplr`` (RWKV-7, fla's ``generalized_delta_rule``): ``chunk``,
                              ``chunk_parts``, ``scores``, ``backward``, ``naive``
:mod:`.scan`                  ``linear_scan`` (Griffin's RG-LRU): ``chunk``, ``compiled``, ``naive``
============================  ==============================================================

The chunked forms (each deriving itself in its docstring) take O(T·C·D + T·D²) time and
make no ``(T, T)`` array; :mod:`.steps` holds what the step loops share. The checked entry
points, below, are in :mod:`.api`.
"""
from .api import (decay_attention, decay_attention_backward, delta_rule, delta_rule_backward, dplr,
                  dplr_backward, linear_scan, linear_scan_backward)

__all__ = ["decay_attention", "decay_attention_backward", "delta_rule", "delta_rule_backward",
           "dplr", "dplr_backward", "linear_scan", "linear_scan_backward"]
