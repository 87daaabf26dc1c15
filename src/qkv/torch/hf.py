"""``attn_implementation="qkv"`` for Hugging Face transformers (extra ``hf``).

:func:`register_hf` registers two functions under one name:

- an **attention function** with transformers' ``AttentionInterface``: it receives a layer's
  ``query (B, Hq, Tq, D)``, ``key``/``value (B, Hkv, Tk, D)`` (K and V never repeated:
  qkv takes ``gqa=True``) and whatever the mask function made, and returns
  ``(out (B, Tq, Hq, D), None)`` like the ``sdpa`` function;
- a **mask function** with ``AttentionMaskInterface`` (:mod:`qkv.torch.hf_masks`), called
  once per forward and pattern by the model's ``create_causal_mask`` & co. Where the pattern
  is plain (causal, bidirectional or a causal sliding window, the last query aligned with
  the last key, as with a dynamic cache) it makes no ``(Tq, Tk)`` mask: the attention
  function gets causality, the window and the padding as qkv options, bottom-right aligned
  so that a decoding step's query sees the whole cache. A right-padded mask becomes
  ``kv_lengths`` (keys past a sequence's end are never read; with causal also
  ``q_lengths``, so that the alignment stays the padded buffer's, as transformers has it).
  Every other pattern (packed sequences, image-token overlays, chunked attention, a static
  cache that is not full) is transformers' own dense bool mask ``(B, 1, Tq, Tk)``, which
  qkv takes as ``mask=``. Packed sequences passed as flash-attention's varlen kwargs
  (``cu_seq_lens_q`` / ``cu_seq_lens_k``, one batch row) keep each sequence to its own keys
  whatever mask the model made (GraniteMoeHybrid makes a plain causal one). Where a
  sequence's keys outnumber its queries (its past first: chunked prefill, transformers'
  continuous batching), each sequence is causal on its own with its last query on its last
  key, as flash-attention's varlen call has it, within the mask function's window, or the
  layer's ``sliding_window`` kwarg where the mask gave none (the model's mask, made for the
  whole buffer, is then not used).

The window is the mask function's own (the one eager attention applies), read from its
closure; a layer's ``sliding_window`` attribute or argument is not consulted (but for packed
sequences with past keys, as above, where no mask came).

A model whose attention layers do not call the ``AttentionInterface`` (Bloom, Falcon before 5.25)
cannot run on qkv: building it with ``attn_implementation="qkv"``, or switching it with
``set_attn_implementation``, raises a ``ValueError`` naming qkv and the model.

Logit soft-capping (``softcap``, Gemma 2), attention dropout (in training mode, with a seed
from torch's generator) and a learned relative-position bias (T5's ``position_bias``, which
gets its gradient) are qkv options; attention sinks (``s_aux``, ``sinks``) are not: they raise.

``output_attentions=True`` returns each layer's weights as eager attention does (``sdpa``
and flash-attention warn and return none; qkv can make them): ``(B, Hq, Tq, Tk)`` after
dropout, from the forward's own mask, at the cost of a dense array per layer. They carry no
gradient: where one is being recorded, a warning says so once.
"""
from __future__ import annotations

import warnings

import torch

from ..errors import ShapeError
from ..extras import require
from . import hf_masks
from .functional import attention
from .hf_masks import hf_mask, plain_pattern  # noqa: F401  (the mask function's public names)

NAME = "qkv"
_NAMES: set[str] = set()  # every name register_hf registered


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                 is_causal=None, position_bias=None, **kwargs):
    """The attention function registered as ``"qkv"``: transformers' call, qkv's kernel.

    ``query (B, Hq, Tq, D)``, ``key``/``value (B, Hkv, Tk, D)``; returns ``(out (B, Tq, Hq, D), None)``,
    or ``(out, weights (B, Hq, Tq, Tk))`` with ``output_attentions=True``.
    """
    for sink in ("s_aux", "sinks"):   # gpt-oss's learned sink a head; Inkling2's a token and head
        if kwargs.get(sink) is not None:
            raise ShapeError(f"{sink} (attention sinks: a logit beside the keys') is not a qkv option; "
                             f"use attn_implementation='eager' for {type(module).__name__}")
    layer_is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # softcap (Gemma 2's attn_logit_softcapping) and dropout (transformers passes 0.0 in eval());
    # the dropout seed comes from torch's generator, as eager's nn.functional.dropout's mask does
    options = dict(scale=scaling, gqa=query.shape[1] != key.shape[1], softcap=kwargs.get("softcap"),
                   dropout_p=float(dropout or 0.0))
    options.update(hf_masks.read_mask(attention_mask, query.shape[0], query.shape[-2], key.shape[-2],
                                      layer_is_causal))
    if position_bias is not None:
        options["bias"] = position_bias if "bias" not in options else options["bias"] + position_bias
    cu = _cu_seq_lens(query, key, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    if cu is not None and torch.equal(*cu):   # packed sequences (flash-attention's varlen kwargs):
        packed = _segments(*cu)[0]             # each sees its own keys, causal within the buffer
        options["mask"] = packed if options.get("mask") is None else options["mask"] & packed
    elif cu is not None:                       # segments with past keys: each bottom-right on its own
        window = options.get("window") or _flash_window(kwargs.get("sliding_window"))
        for name in ("mask", "causal", "window", "q_lengths", "kv_lengths"):
            options.pop(name, None)
        options["mask"] = _varlen_mask(*cu, layer_is_causal, window)
    if not kwargs.get("output_attentions"):
        out = attention(query, key, value, **options)  # (B, Hq, Tq, D)
        return out.transpose(1, 2).contiguous(), None  # (B, Tq, Hq, D)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        warnings.warn("attn_implementation='qkv' returns the attention weights of output_attentions=True "
                      "without a gradient: a loss on them does not reach the model (use 'eager' for that)",
                      stacklevel=2)
    out, weights = attention(query, key, value, return_weights=True, **options)  # the forward's dropout mask
    return out.transpose(1, 2).contiguous(), weights


def _cu_seq_lens(query, key, cu_q, cu_k):
    """``(cu_q, cu_k)`` as int64 tensors, checked: the cumulative lengths transformers passes as
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (one batch row of sequences laid end to end, as
    flash-attention's varlen call takes them); None without them."""
    if cu_q is None or cu_k is None:
        return None
    if query.shape[0] != 1:
        raise ShapeError(f"cu_seq_lens_q (packed sequences) needs one batch row; got a batch of {query.shape[0]}")
    cu_q, cu_k = (torch.as_tensor(c, device=query.device).to(torch.int64) for c in (cu_q, cu_k))
    if int(cu_q[-1]) != query.shape[-2] or int(cu_k[-1]) != key.shape[-2] or len(cu_q) != len(cu_k):
        raise ShapeError(f"cu_seq_lens_q / cu_seq_lens_k must end at Tq = {query.shape[-2]} and Tk = "
                         f"{key.shape[-2]} with one entry a sequence each; got {cu_q.tolist()} and {cu_k.tolist()}")
    return cu_q, cu_k


def _segments(cu_q, cu_k):
    """``(same, i', j)``: ``same (Tq, Tk)`` True where query and key are of one sequence; each
    query's position ``i'`` in its sequence's keys, bottom-right aligned (``i' = i - start_q +
    Tk_s - Tq_s``: its last query on its last key), ``(Tq, 1)``; each key's position ``j``, ``(1, Tk)``."""
    seq = torch.arange(len(cu_q) - 1, device=cu_q.device)
    nq, nk = torch.diff(cu_q), torch.diff(cu_k)
    seg_q, seg_k = torch.repeat_interleave(seq, nq), torch.repeat_interleave(seq, nk)
    i = torch.arange(int(cu_q[-1]), device=cu_q.device) - cu_q[seg_q] + (nk - nq)[seg_q]
    j = torch.arange(int(cu_k[-1]), device=cu_k.device) - cu_k[seg_k]
    return seg_q[:, None] == seg_k[None, :], i[:, None], j[None, :]


def _varlen_mask(cu_q, cu_k, causal: bool, window):
    """``(Tq, Tk)`` bool: flash-attention's varlen rule. Query i of a sequence with ``Tq_s``
    queries and ``Tk_s`` keys (its past first) sees the keys j of its own sequence with
    ``i' - left <= j <= i'`` when causal (``i' = i + Tk_s - Tq_s``; ``window=(left, right)``,
    right ignored as under causal), every key of its own otherwise. Past 2, 3 queries::

        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1
    """
    same, i, j = _segments(cu_q, cu_k)
    if causal:
        same = same & (j <= i)
        if window is not None:
            same = same & (j >= i - window[0])
    return same


def _flash_window(sliding_window):
    """The window a layer's ``sliding_window`` kwarg gives flash-attention: the query and the
    ``sliding_window - 1`` keys before it."""
    return None if sliding_window is None else (int(sliding_window) - 1, 0)


# --- models that cannot use the interface ----------------------------------------------------

def _uses_attention_interface(cls) -> bool:
    """Whether a model class's attention layers call transformers' ``AttentionInterface``, by
    transformers' own two signs: the class says so (``_supports_attention_backend``), or its
    module's attention classes fetch their function from ``ALL_ATTENTION_FUNCTIONS``."""
    if getattr(cls, "_supports_attention_backend", False):
        return True
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    return True if can_set is None else bool(can_set())


def check_model(model_class, name: str = NAME) -> None:
    """Raise a ValueError naming qkv and the model where ``model_class`` cannot run on qkv."""
    if not _uses_attention_interface(model_class):
        raise ValueError(
            f"attn_implementation={name!r} (qkv) needs a model whose attention layers call transformers' "
            f"AttentionInterface; {model_class.__name__} ({model_class.__module__}) has its own attention code, "
            "so qkv would never run in it. Use attn_implementation='eager' or 'sdpa' for this model (or set "
            "_supports_attention_backend = True on a custom model class that does use the interface)")


def _requested(attn_implementation):
    """The implementation asked for the model itself by ``set_attn_implementation``'s argument."""
    return attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation


def _install_model_checks(pretrained_model) -> None:
    """Wrap ``PreTrainedModel``'s two entry points for an attention implementation (the check
    every model makes in ``__init__``, and ``set_attn_implementation``) so that a qkv name
    for a model that cannot use it raises instead of a ``KeyError`` or a silent fallback."""
    if getattr(pretrained_model, "_qkv_checks_installed", False):
        return
    get_correct = pretrained_model.get_correct_attn_implementation
    set_impl = pretrained_model.set_attn_implementation

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention in _NAMES:
            check_model(type(self), requested_attention)
        return get_correct(self, requested_attention, *args, **kwargs)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        requested = _requested(attn_implementation)
        if requested in _NAMES:
            models = [self] if isinstance(attn_implementation, dict) else \
                [m for m in self.modules() if isinstance(m, pretrained_model)]
            for model in models:
                check_model(type(model), requested)
        return set_impl(self, attn_implementation, *args, **kwargs)

    get_correct_attn_implementation.__doc__ = get_correct.__doc__
    set_attn_implementation.__doc__ = set_impl.__doc__
    pretrained_model.get_correct_attn_implementation = get_correct_attn_implementation
    pretrained_model.set_attn_implementation = set_attn_implementation
    pretrained_model._qkv_checks_installed = True


def register_hf(name: str = NAME, *, recurrent: bool | None = None) -> str:
    """Register qkv with transformers as ``attn_implementation=name`` (default ``"qkv"``).

    After it, ``AutoModel.from_pretrained(path, attn_implementation="qkv")`` (or
    ``model.set_attn_implementation("qkv")``) runs every attention layer of the model on
    :func:`qkv.torch.attention`; a model whose layers do not go through transformers'
    ``AttentionInterface`` raises a ValueError there instead. Returns the name.

    ``recurrent=True`` also makes every transformers model (whose modeling module is imported
    before or after the call) run its recurrent kernel functions (fla's
    ``chunk_gated_delta_rule``, mamba_ssm's ``mamba_chunk_scan_combined``, causal_conv1d's
    ``causal_conv1d_fn``, ...) on CPU tensors with qkv's of the same name in
    :mod:`qkv.torch.hf_kernels` instead of transformers' torch fallbacks, whatever the
    attention implementation (:mod:`qkv.torch.hf_recurrent`); ``recurrent=False`` puts
    transformers' functions back; ``None`` leaves that as it is.
    """
    require("transformers", "hf")
    if recurrent is not None:
        from . import hf_recurrent

        (hf_recurrent.enable if recurrent else hf_recurrent.disable)()
    from transformers import AttentionInterface, PreTrainedModel, masking_utils

    hf_masks.bind(masking_utils)
    AttentionInterface.register(name, hf_attention)
    masking_utils.AttentionMaskInterface.register(name, hf_mask)
    _NAMES.add(name)
    _install_model_checks(PreTrainedModel)
    return name
