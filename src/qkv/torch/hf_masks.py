"""The mask function of ``attn_implementation="qkv"``: what a transformers mask pattern hands
qkv's attention function, and how that function reads it back.

transformers builds a layer's mask by calling the registered mask function once per forward
and pattern (``create_causal_mask``, ``create_sliding_window_causal_mask``, ...) with a
``mask_function(b, h, q, kv) -> bool`` that *is* the pattern: eager attention uses exactly
the mask made from it. So the pattern, and a sliding window's size, are read from that
function (its identity and its closure), never from a layer's ``sliding_window`` attribute
or argument: that is flash-attention's convention where a family has one (ModernBERT's is
``config.sliding_window + 1``), and some have none (Qwen2-MoE's layers pass no window).

What :func:`hf_mask` returns, and what :func:`read_mask` makes of it (``Tq``/``Tk`` are the
layer's query and key lengths; ``L = kv_offset + kv_length`` is the whole history):

============================  ==========================================================
returned                      meaning
============================  ==========================================================
``None``                      a causal pattern without padding: causality is the layer's
                              (``is_causal``), as for ``sdpa`` (bottom-right aligned)
bool ``(B, L)``               a causal pattern, queries aligned with the last keys; True =
                              a real key. The layer's keys are its last ``Tk`` columns
int32 ``(B, L)``              a causal sliding window ``W`` that some query reaches past:
                              ``W`` at real keys, 0 at padding (``window=(W - 1, 0)``)
bool ``(B, 1, Tq | 1, Tk)``   complete: nothing is added to it (bidirectional padding,
                              and every other pattern, made by transformers' ``sdpa_mask``;
                              and any pattern where the model asks for the whole mask,
                              ``allow_is_causal_skip=False``, to lay its own selection over it)
============================  ==========================================================

A 2-D mask holds the whole history and is cut only from the right, so that transformers,
which treats a 2-D mask as a user's padding mask and builds a layer's mask again from it
(``generate`` with a static cache does), gets the same mask back. Under ``torch.compile``
the closure is not read (dynamo cannot): a sliding window is then a complete mask.

transformers hands every layer of a pattern the same mask object, so :func:`read_mask`
translates a mask once a forward, not once a layer: it keeps its last few translations, each
under a weak reference to its mask and the mask's version counter (bumped by every in-place
change), shape, dtype and data pointer, and the layer's sizes. Another mask object, or the
same one changed in place, is translated again; so is any mask under ``torch.compile`` or in
``inference_mode`` (whose tensors count no versions).
"""
from __future__ import annotations

import weakref

import torch

from ..errors import ShapeError

_MU = None  # transformers.masking_utils, bound by bind() at register time: nothing imports while tracing


def bind(masking_utils) -> None:
    """Keep transformers' ``masking_utils`` for the mask function (called by ``register_hf``)."""
    global _MU
    _MU = masking_utils


def _closure(fn, factory: str) -> dict:
    """The captured variables of a closure made by transformers' function ``factory``, or {}."""
    if not getattr(fn, "__qualname__", "").startswith(factory + ".<locals>."):
        return {}
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def plain_pattern(mask_function) -> tuple[str, int | None] | None:
    """``("causal", None)``, ``("bidirectional", None)`` or ``("sliding", W)`` for the mask
    functions whose pattern qkv applies as structure; None for any other (a dense mask)."""
    mu = _MU
    if mask_function is mu.causal_mask_function:
        return "causal", None
    if mask_function is mu.bidirectional_mask_function:
        return "bidirectional", None
    if torch.compiler.is_compiling():  # dynamo reads no closure cells: the caller builds a dense mask
        return None
    parts = _closure(mask_function, "and_masks").get("mask_functions")  # sliding_window_causal_mask_function(W)
    if parts and len(parts) == 2 and parts[1] is mu.causal_mask_function:
        window = _closure(parts[0], "sliding_window_overlay").get("sliding_window")
        if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
            return "sliding", window
    return None


def hf_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
            mask_function=None, attention_mask=None, **kwargs):
    """The mask function registered as ``"qkv"``: None, a 2-D ``(B, L)`` or a 4-D mask, as
    the module's docstring says."""
    mu = _MU
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    kind, window = plain_pattern(mask_function) or (None, None)
    ints = isinstance(q_offset, int) and isinstance(kv_offset, int)
    aligned = ints and q_offset + q_length == kv_offset + kv_length  # the last query is the last key
    if kind == "sliding" and aligned and kv_length <= window:
        kind = "causal"  # no query here reaches a key past its window
    history = kv_offset + kv_length
    if kind == "bidirectional":
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return torch.ones(batch_size, 1, 1, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
        return padding[:, None, None, kv_offset:history].to(torch.bool)  # (B, 1, 1, Tk): complete for every query
    if kind is not None and aligned and kwargs.get("allow_is_causal_skip", True) is not False:
        # (a model that overlays its own selection on the mask asks for the whole mask:
        # allow_is_causal_skip=False, as Qwen4-Exp's indexed attention and Doge do)
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is not None:
            padding = padding[:, :history].to(torch.bool)  # (B, L): cut from the right only
        if kind == "causal":
            if padding is None or (not torch.compiler.is_compiling() and bool(padding.all())):
                return None
            return padding
        if padding is None:
            padding = torch.ones(batch_size, history, dtype=torch.bool, device=kwargs.get("device", "cpu"))
        return padding.to(torch.int32) * window  # (B, L): W at real keys, 0 at padding
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"))


# --- the attention function's side ----------------------------------------------------------

def _padding(keys: torch.Tensor) -> dict:
    """A bool padding mask ``(B, Tk)`` as no option when all True, as ``kv_lengths`` when every
    row is ones then zeros (right padding), else as a ``(B, 1, 1, Tk)`` mask."""
    if not torch.compiler.is_compiling():
        lengths = keys.sum(dim=-1)
        if bool((lengths == keys.shape[-1]).all()):
            return {}
        if bool((keys == (torch.arange(keys.shape[-1], device=keys.device) < lengths[:, None])).all()):
            return {"kv_lengths": lengths}
    return {"mask": keys[:, None, None, :]}


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


def _sliding_mask(reach: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """The complete bool mask ``(B, 1, Tq, Tk)`` of an int32 sliding-window mask's last ``Tk``
    keys, made with tensor operations only (for a mask made eagerly but read under
    ``torch.compile``): query i, at ``i' = i + Tk - Tq``, sees key j when ``0 <= i' - j < W``."""
    keys = reach[:, -tk:]  # (B, Tk)
    distance = torch.arange(tq, device=keys.device)[:, None] + (tk - tq) - torch.arange(tk, device=keys.device)
    return ((distance >= 0) & (distance < keys[:, None, :]))[:, None]  # (Tq,Tk) vs (B,1,Tk) -> (B,1,Tq,Tk)


KEPT = 4  # translations kept: one a mask pattern (a hybrid model has two) and a spare
_kept: list = []  # (weak reference to the mask, key, options), the newest first


def _key(mask: torch.Tensor, *sizes):
    """What a kept translation of ``mask`` must match besides the object itself: None where no
    version is counted (an inference tensor), so nothing is kept."""
    try:
        version = mask._version
    except RuntimeError:  # inference_mode's tensors count no in-place changes
        return None
    return (version, tuple(mask.shape), mask.dtype, mask.data_ptr()) + sizes


def read_mask(mask, b: int, tq: int, tk: int, layer_is_causal: bool) -> dict:
    """qkv options for what :func:`hf_mask` (or a caller) passed as the ``attention_mask`` of a
    layer with ``B`` sequences, ``Tq`` queries and ``Tk`` keys: translated once for all the
    layers that get the same, unchanged mask (see the module docstring)."""
    if mask is None:
        return {"causal": "bottom_right"} if layer_is_causal else {}
    if mask.ndim == 4 and not (mask.dtype == torch.bool and mask.shape[0] == b and mask.shape[-3:-1] == (1, 1)):
        return {"mask": mask} if mask.dtype == torch.bool else {"bias": mask}  # complete: nothing to translate
    if torch.compiler.is_compiling():
        return translate(mask, b, tq, tk, layer_is_causal)
    key = _key(mask, b, tq, tk, bool(layer_is_causal))
    for ref, kept_key, options in _kept:
        if key is not None and ref() is mask and kept_key == key:
            return dict(options)
    options = translate(mask, b, tq, tk, layer_is_causal)
    if key is not None:
        _kept.insert(0, (weakref.ref(mask), key, options))
        del _kept[KEPT:]
    return dict(options)


def translate(mask: torch.Tensor, b: int, tq: int, tk: int, layer_is_causal: bool) -> dict:
    """:func:`read_mask`'s work for a 2-D mask or a 4-D one of one row ``(B, 1, 1, Tk)``."""
    if mask.ndim == 4:  # (B, 1, 1, Tk): padding, or Tq = 1
        return _padding(mask[:, 0, 0, :])
    if mask.ndim != 2 or mask.dtype not in (torch.bool, torch.int32):
        raise ShapeError(f"qkv's attention function got an attention_mask of shape {tuple(mask.shape)} and dtype "
                         f"{mask.dtype}; expected None, (B, L) bool or int32 from qkv's mask function, or "
                         "(B, 1, Tq, Tk)")
    options = {"causal": "bottom_right"}
    keys = mask[:, -tk:]  # (B, Tk): the layer's keys are the history's last Tk positions
    if mask.dtype == torch.int32:  # a sliding window, W at real keys
        if torch.compiler.is_compiling():
            return {"mask": _sliding_mask(mask, tq, tk)}
        window = int(mask.amax())
        if window >= 1:
            options["window"] = (window - 1, 0)
        keys = keys > 0
    options.update(_padding(keys))
    if "kv_lengths" in options:
        options.update(_aligned_to_the_buffer(options.pop("kv_lengths"), tq, tk))
    return options
