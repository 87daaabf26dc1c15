"""``attn_implementation="qkv"`` for Hugging Face transformers (extra ``hf``).

:func:`register_hf` registers two functions under one name:

- an **attention function** with transformers' ``AttentionInterface``: it receives a layer's
  ``query (B, Hq, Tq, D)``, ``key``/``value (B, Hkv, Tk, D)`` (K and V never repeated:
  qkv takes ``gqa=True``) and whatever the mask function made, and returns
  ``(out (B, Tq, Hq, D), None)`` like the ``sdpa`` function;
- a **mask function** with ``AttentionMaskInterface``, called once per forward by the
  model's ``create_causal_mask`` & co. Like the flash-attention one it makes no
  ``(Tq, Tk)`` mask when the pattern is plain: causal, bidirectional or a causal sliding
  window, with the last query aligned to the last key (always true with a dynamic cache).
  Then it returns the 2-D padding mask ``(B, Tk)`` or ``None``, and the attention function
  takes causality from ``is_causal`` (the layer's, or the call's), the window from the
  layer's ``sliding_window`` (as flash-attention does: keys ``j > i' - W``, i.e.
  ``window=(W - 1, 0)``), bottom-right aligned so that a decoding step's query sees the
  whole cache. A right-padded mask becomes ``kv_lengths`` (keys past a sequence's end are
  never read; with causal also ``q_lengths``, so that the alignment stays the padded
  buffer's, as transformers has it), any other padding a ``(B, 1, 1, Tk)`` bool mask. Every other pattern
  (packed sequences, image-token overlays, chunked attention, a static cache) is left to
  transformers' own dense bool mask ``(B, 1, Tq, Tk)``, which qkv takes as ``mask=``.

Dropout, logit soft-capping and attention sinks are not qkv options: they raise.
"""
from __future__ import annotations

import inspect

import torch

from ..errors import ShapeError
from ..extras import require
from .functional import attention

NAME = "qkv"


def _closure_value(fn, factory: str, var: str):
    """The captured ``var`` of a closure made by transformers' function ``factory``, or None."""
    if not getattr(fn, "__qualname__", "").startswith(factory + ".<locals>."):
        return None
    return inspect.getclosurevars(fn).nonlocals.get(var)


def plain_pattern(mask_function) -> str | None:
    """``"causal"``, ``"sliding"`` or ``"bidirectional"`` for the mask functions whose pattern
    qkv applies without a mask; None for any other (which then gets a dense mask)."""
    mu = require("transformers.masking_utils", "hf")
    if mask_function is mu.causal_mask_function:
        return "causal"
    if mask_function is mu.bidirectional_mask_function:
        return "bidirectional"
    parts = _closure_value(mask_function, "and_masks", "mask_functions")  # sliding_window_causal_mask_function(W)
    if parts and len(parts) == 2 and parts[1] is mu.causal_mask_function \
            and isinstance(_closure_value(parts[0], "sliding_window_overlay", "sliding_window"), int):
        return "sliding"
    return None


def hf_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
            mask_function=None, attention_mask=None, **kwargs):
    """The mask function registered as ``"qkv"`` (see the module's docstring): ``None`` or a
    2-D bool padding mask ``(B, Tk)`` for a plain pattern, else a dense ``(B, 1, Tq, Tk)``."""
    mu = require("transformers.masking_utils", "hf")
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    pattern = plain_pattern(mask_function)
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
    if pattern == "bidirectional" or (pattern is not None and aligned):
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]  # (B, Tk)
        if not torch.compiler.is_compiling() and bool(padding.all()):
            return None
        return padding
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"))


def _padding(mask: torch.Tensor) -> dict:
    """A 2-D bool padding mask ``(B, Tk)`` as ``kv_lengths`` when every row is ones then zeros
    (right padding), else as a ``(B, 1, 1, Tk)`` mask."""
    if not torch.compiler.is_compiling():
        lengths = mask.sum(dim=-1)
        if bool((mask == (torch.arange(mask.shape[-1]) < lengths[:, None])).all()):
            return {"kv_lengths": lengths}
    return {"mask": mask[:, None, None, :]}


def _aligned_to_the_buffer(kv_lengths: torch.Tensor, tq: int, tk: int) -> dict:
    """transformers aligns a causal query to the padded key buffer (query i is at position
    ``i + Tk - Tq``); qkv aligns bottom-right to each sequence's real lengths. With right
    padding the two agree when the query rows past the keys are padding too:
    ``q_lengths = kv_lengths - (Tk - Tq)`` (those rows are padding tokens whose output
    nobody reads). Where that is not a length in ``[0, Tq]``, the keys go as a mask."""
    q_lengths = kv_lengths - (tk - tq)
    if bool(((q_lengths >= 0) & (q_lengths <= tq)).all()):
        return {"kv_lengths": kv_lengths, "q_lengths": q_lengths}
    return {"mask": (torch.arange(tk) < kv_lengths[:, None])[:, None, None, :]}


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                 is_causal=None, sliding_window=None, position_bias=None, **kwargs):
    """The attention function registered as ``"qkv"``: transformers' call, qkv's kernel.

    ``query (B, Hq, Tq, D)``, ``key``/``value (B, Hkv, Tk, D)``; returns ``(out (B, Tq, Hq, D), None)``.
    """
    if dropout:
        raise ShapeError(f"attention dropout is not a qkv option; got dropout={dropout} (use model.eval(), "
                         "or attention_dropout=0 in the config, to train with qkv)")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ShapeError(f"{name} is not a qkv option; use attn_implementation='eager' for this model")
    options = dict(scale=scaling, gqa=query.shape[1] != key.shape[1])
    if position_bias is not None:
        options["bias"] = position_bias
    mask = attention_mask
    if mask is not None and mask.ndim == 4:  # transformers' dense mask: it says everything
        if mask.dtype == torch.bool:
            options["mask"] = mask
        else:
            options["bias"] = mask if position_bias is None else mask + position_bias
    else:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if causal:
            options["causal"] = "bottom_right"
            if sliding_window is not None:
                options["window"] = (int(sliding_window) - 1, 0)
        if mask is not None:
            options.update(_padding(mask.to(torch.bool)))
        if causal and "kv_lengths" in options:
            options.update(_aligned_to_the_buffer(options.pop("kv_lengths"), query.shape[-2], key.shape[-2]))
    out = attention(query, key, value, **options)  # (B, Hq, Tq, D)
    return out.transpose(1, 2).contiguous(), None  # (B, Tq, Hq, D)


def register_hf(name: str = NAME) -> str:
    """Register qkv with transformers as ``attn_implementation=name`` (default ``"qkv"``).

    After it, ``AutoModel.from_pretrained(path, attn_implementation="qkv")`` (or
    ``model.set_attn_implementation("qkv")``) runs every attention layer that goes through
    transformers' ``AttentionInterface`` on :func:`qkv.torch.attention`. Returns the name.
    """
    require("transformers", "hf")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, hf_attention)
    AttentionMaskInterface.register(name, hf_mask)
    return name
