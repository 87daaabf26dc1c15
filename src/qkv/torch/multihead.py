"""Multi-head attention as a PyTorch module on qkv's attention: the twin of
:class:`qkv.nn.MultiHeadAttention` (MHA/GQA/MQA, self or cross, causal, window, RoPE,
ALiBi, biases, kv_lengths, a KV cache), with the same weights convertible both ways.

Forward, for ``x (B, T, d_model)`` and the key/value source ``s`` (``x``, or ``context``)::

    q = split(q_proj(x))            (B, Hq,  T,  D)
    k = split(k_proj(s))            (B, Hkv, Tk, D)
    v = split(v_proj(s))            (B, Hkv, Tk, D)
    q, k = rope(q), rope(k)         (optional; positions offset by each sequence's cache length)
    o = attention(q, k, v, gqa)     (B, Hq,  T,  D)   K and V never repeated
    y = o_proj(merge(o))            (B, T, d_model)

``q_proj`` … ``o_proj`` are ``nn.Linear``: their ``weight`` is the NumPy layer's ``W_Q.T``
and so on, their ``bias`` its ``b_Q``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import nn as qnn
from ..errors import ShapeError, positive_int
from ..nn.checks import (attention_options, cache_step, check_cache, check_context, check_sequences, head_layout,
                         mask_options, rope_options)
from ..options import parse_dropout, parse_softcap
from ..positional import alibi_slopes
from .functional import attention
from .modules import copy_linear, linear_arrays, numpy_dtype, rope, torch_dtype

_PROJ = (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V"), ("o_proj", "O"))


class KVCache(qnn.Cache):
    """Keys ``k (B, Hkv, max_len, D)`` and values ``v`` of one layer, preallocated tensors.

    The bookkeeping is :class:`qkv.nn.Cache`'s: sequence b holds ``lengths[b]`` tokens
    (a NumPy ``(B,)``; ``length`` is the longest), so prompts of different lengths are
    prefilled together (right-padded, ``q_lengths=``) and then decoded one token per
    sequence per step. Stored keys are after RoPE and carry no autograd history (as in
    :class:`qkv.nn.KVCache`, earlier tokens are constants for the gradient). Writing past
    ``max_len`` raises :class:`~qkv.ShapeError` and leaves the cache as it was.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, dtype=torch.float32):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        super().__init__({"k": torch.zeros(batch, n_kv_heads, max_len, d_head, dtype=dtype),
                          "v": torch.zeros(batch, n_kv_heads, max_len, d_head, dtype=dtype)})

    @property
    def k(self) -> torch.Tensor:
        """All stored keys ``(B, Hkv, max_len, D)`` (positions past a sequence's length hold nothing of meaning)."""
        return self.arrays["k"]

    @property
    def v(self) -> torch.Tensor:
        """All stored values ``(B, Hkv, max_len, D)``."""
        return self.arrays["v"]

    def write(self, counts: np.ndarray | None = None, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`qkv.nn.Cache.write` for tensors: the new tokens are stored as constants
        (no autograd history); returns views over positions ``0 .. max_b(lengths[b] + counts[b]) - 1``."""
        with torch.no_grad():
            return super().write(counts, **new)


def _with_graph(stored: torch.Tensor, new: torch.Tensor, start, counts: np.ndarray) -> torch.Tensor:
    """``stored (B, Hkv, end, D)`` (constants, from the cache) with this call's ``new (B, Hkv, T, D)``
    rows put back at their places, so that they keep their autograd graph: sequence b's first
    ``counts[b]`` rows at ``start[b] ..`` (``start`` an int when every sequence is as long)."""
    if isinstance(start, int):
        return torch.cat([stored[:, :, :start], new], dim=2)  # (B, Hkv, start+T, D)
    out = stored.clone()
    for b, (s0, n) in enumerate(zip(start.tolist(), counts.tolist())):
        out[b, :, s0:s0 + n] = new[b, :, :n]
    return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads.

    The options are those of :class:`qkv.nn.MultiHeadAttention`: ``n_kv_heads`` (GQA; 1 is
    MQA; query heads ``h*G .. h*G+G-1`` share kv head h), ``causal`` (bottom-right aligned
    with a cache), ``window`` (``n`` or ``(left, right)``), ``rope`` (half-split, base
    ``rope_base``), ``alibi`` (the paper's slopes), ``bias`` (on all four projections),
    ``scale`` (default ``1/sqrt(d_head)``), ``softcap``, ``dropout`` (in training mode only,
    each call's seed drawn from torch's generator). :meth:`from_numpy` / :meth:`to_numpy` convert
    to and from the NumPy layer with the same weights and outputs.

    >>> import torch
    >>> mha = MultiHeadAttention(16, 4, n_kv_heads=2, causal=True, rope=True)
    >>> x = torch.randn(2, 5, 16)
    >>> cache = mha.new_cache(batch=2, max_len=8)
    >>> steps = [mha(x[:, :3], cache=cache), mha(x[:, 3:], cache=cache)]
    >>> torch.allclose(torch.cat(steps, dim=1), mha(x), atol=1e-5)
    True
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 d_head: int | None = None, causal=False, align=None, window=None, chunk=None,
                 rope: bool = False, alibi: bool = False, bias: bool = False, scale: float | None = None,
                 rope_base: float = 10000.0, softcap=None, dropout: float = 0.0, dtype=torch.float32,
                 device=None):
        super().__init__()
        # the NumPy layer's checks (qkv.nn.checks), so both refuse the same arguments in the same words
        self.d_model = positive_int("d_model", d_model)
        mask_options(causal, align, window, chunk)
        self.n_heads, self.n_kv_heads, self.d_head = head_layout(self.d_model, n_heads, n_kv_heads, d_head)
        self.rope_base = rope_options(rope, self.d_head, rope_base)
        self.causal, self.align, self.window, self.chunk, self.scale = causal, align, window, chunk, scale
        self.softcap, self.dropout = parse_softcap(softcap), parse_dropout(dropout, 0)[0]
        self.rope, self.alibi, self.bias = bool(rope), bool(alibi), bool(bias)
        slopes = torch.from_numpy(alibi_slopes(self.n_heads)) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        hq, hkv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        kw = dict(bias=self.bias, dtype=torch_dtype(dtype), device=device)
        self.q_proj = nn.Linear(self.d_model, hq, **kw)
        self.k_proj = nn.Linear(self.d_model, hkv, **kw)
        self.v_proj = nn.Linear(self.d_model, hkv, **kw)
        self.o_proj = nn.Linear(hq, self.d_model, **kw)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"d_head={self.d_head}, causal={self.causal!r}, align={self.align!r}, window={self.window!r}, "
                f"chunk={self.chunk!r}, rope={self.rope}, "
                f"alibi={self.alibi}")

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        return KVCache(batch, self.n_kv_heads, max_len, self.d_head, self.q_proj.weight.dtype)

    def _sequences(self, name: str, x) -> tuple[torch.Tensor, bool]:
        """``x`` as ``(B, T, d_model)``, and whether it came 2-D (the NumPy layer's shape rule)."""
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor of shape (B, T, d_model) or (T, d_model); "
                             f"got {type(x).__name__}")
        squeezed = check_sequences(name, tuple(x.shape), self.d_model)
        return (x[None], True) if squeezed else (x, False)

    def _split(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = y.shape
        return y.view(b, t, heads, self.d_head).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)

    def forward(self, x, context=None, *, kv_lengths=None, q_lengths=None, cache: KVCache | None = None):
        """Attend from ``x (B, T, d_model)`` to itself, or to ``context (B, Tc, d_model)``.

        ``kv_lengths (B,)``: keys at positions ``>= kv_lengths[b]`` are ignored;
        ``q_lengths (B,)``: rows of ``x`` at or past them are padding (output 0).
        ``cache`` (from :meth:`new_cache`; needs ``causal``, no ``context``): as in
        :meth:`qkv.nn.MultiHeadAttention.forward`, each sequence's new tokens (its first
        ``q_lengths[b]`` rows: right-padded prompts of different lengths are prefilled
        together) are appended after its own stored ones, and its queries attend to what it
        has stored, bottom-right aligned to its own length, with RoPE positions counting from
        it. A full cache raises :class:`~qkv.ShapeError` and stays unchanged. With grad on,
        this call's keys keep their graph and the stored ones are constants.
        Returns ``y (B, T, d_model)``.
        """
        x3, squeezed = self._sequences("x", x)
        cross = context is not None
        src = x3
        if cross:
            src = self._sequences("context", context)[0]
            check_context(tuple(x.shape), tuple(context.shape))
        check_cache(cache, self.new_cache, causal=self.causal, cross=cross)
        start, counts, kv_len, q_len = 0, None, kv_lengths, q_lengths
        if cache is not None:
            start, counts, kv_len, q_len = cache_step(cache, x3.shape[1], kv_lengths, q_lengths)
        q = self._split(self.q_proj(x3), self.n_heads)  # (B,T,d_model) -> (B,Hq,T,D)
        k = self._split(self.k_proj(src), self.n_kv_heads)  # (B,Tk,d_model) -> (B,Hkv,Tk,D)
        v = self._split(self.v_proj(src), self.n_kv_heads)  # (B,Tk,d_model) -> (B,Hkv,Tk,D)
        if self.rope:
            q, k = rope(q, start, self.rope_base), rope(k, start, self.rope_base)
        if cache is not None:
            stored = cache.write(counts, k=k, v=v)  # (B, Hkv, end, D), end = max_b(lengths[b] + counts[b])
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # this call's keys keep their graph
                k, v = _with_graph(stored["k"], k, start, counts), _with_graph(stored["v"], v, start, counts)
            else:  # decoding: attend to the stored keys in place
                k, v = stored["k"], stored["v"]
        opts = attention_options(causal=self.causal, align=self.align, window=self.window, chunk=self.chunk,
                                 alibi=self.alibi_slopes, scale=self.scale, gqa=True,
                                 kv_lengths=kv_len, q_lengths=q_len, cached=cache is not None,
                                 softcap=self.softcap, dropout_p=self.dropout if self.training else 0.0)
        out = attention(q, k, v, **opts)  # (B, Hq, T, D); a dropout seed from torch's generator
        if cache is not None:
            cache.advance(counts)
        b, _, t, _ = out.shape
        y = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head))  # (B,T,Hq*D) -> (B,T,d_model)
        return y[0] if squeezed else y

    @classmethod
    def from_numpy(cls, layer: qnn.MultiHeadAttention) -> "MultiHeadAttention":
        """This module with the weights and options of a :class:`qkv.nn.MultiHeadAttention`."""
        if not isinstance(layer, qnn.MultiHeadAttention):
            raise ShapeError(f"layer must be a qkv.nn.MultiHeadAttention; got {type(layer).__name__}")
        mod = cls(layer.d_model, layer.n_heads, n_kv_heads=layer.n_kv_heads, d_head=layer.d_head,
                  causal=layer.causal, align=layer.align, window=layer.window, chunk=layer.chunk,
                  rope=layer.rope, alibi=layer.alibi is not None,
                  bias=layer.bias, scale=layer.scale, rope_base=getattr(layer, "rope_base", 10000.0),
                  softcap=layer.softcap, dropout=layer.dropout,
                  dtype=torch_dtype(layer.dtype))
        for attr, name in _PROJ:
            b = layer.params["b_" + name] if layer.bias else None
            copy_linear(getattr(mod, attr), layer.params["W_" + name], b)
        return mod

    def to_numpy(self) -> qnn.MultiHeadAttention:
        """A :class:`qkv.nn.MultiHeadAttention` with this module's weights and options."""
        layer = qnn.MultiHeadAttention(self.d_model, self.n_heads, n_kv_heads=self.n_kv_heads, d_head=self.d_head,
                                       causal=self.causal, align=self.align, window=self.window,
                                       chunk=self.chunk, rope=self.rope, alibi=self.alibi,
                                       bias=self.bias, scale=self.scale, rope_base=self.rope_base,
                                       softcap=self.softcap, dropout=self.dropout,
                                       dtype=numpy_dtype(self.q_proj.weight.dtype))
        for attr, name in _PROJ:
            w, b = linear_arrays(getattr(self, attr))
            layer.params["W_" + name][...] = w
            if self.bias:
                layer.params["b_" + name][...] = b
        return layer
