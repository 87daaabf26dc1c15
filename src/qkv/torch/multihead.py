"""Multi-head attention as a PyTorch module on qkv's attention: the twin of
:class:`qkv.nn.MultiHeadAttention` (MHA/GQA/MQA, self or cross, causal, window, RoPE,
ALiBi, biases, kv_lengths, a KV cache), with the same weights convertible both ways.

Forward, for ``x (B, T, d_model)`` and the key/value source ``s`` (``x``, or ``context``)::

    q = split(q_proj(x))            (B, Hq,  T,  D)
    k = split(k_proj(s))            (B, Hkv, Tk, D)
    v = split(v_proj(s))            (B, Hkv, Tk, D)
    q, k = rope(q), rope(k)         (optional; positions offset by the cache length)
    o = attention(q, k, v, gqa)     (B, Hq,  T,  D)   K and V never repeated
    y = o_proj(merge(o))            (B, T, d_model)

``q_proj`` … ``o_proj`` are ``nn.Linear``: their ``weight`` is the NumPy layer's ``W_Q.T``
and so on, their ``bias`` its ``b_Q``.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .. import nn as qnn
from ..errors import ShapeError, fmt_shape, positive_int
from ..options import parse_alignment, parse_chunk, parse_window
from ..nn.base import head_width
from ..positional import alibi_slopes
from .functional import attention
from .modules import copy_linear, linear_arrays, numpy_dtype, rope, torch_dtype

_PROJ = (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V"), ("o_proj", "O"))


class KVCache:
    """Keys ``k (B, Hkv, max_len, D)`` and values ``v`` of one layer, preallocated tensors.

    ``length`` tokens are filled. Stored keys are after RoPE and carry no autograd history
    (as in :class:`qkv.nn.KVCache`, earlier tokens are constants for the gradient). Writing
    past ``max_len`` raises :class:`~qkv.ShapeError` and leaves the cache as it was.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, dtype=torch.float32):
        batch, max_len = positive_int("batch", batch), positive_int("max_len", max_len)
        self.k = torch.zeros(batch, n_kv_heads, max_len, d_head, dtype=dtype)
        self.v = torch.zeros(batch, n_kv_heads, max_len, d_head, dtype=dtype)
        self.batch, self.max_len, self.length = batch, max_len, 0

    @property
    def nbytes(self) -> int:
        """Bytes held (allocated for all ``max_len`` tokens)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def write(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store ``k``, ``v (B, Hkv, T, D)`` at ``length .. length+T-1``; return ``length+T``.
        :meth:`advance` moves ``length`` once the step succeeded."""
        want = self.k.shape[:2] + (k.shape[2],) + self.k.shape[3:]
        for name, x in (("k", k), ("v", v)):
            if x.shape != want:
                raise ShapeError(f"the new {name} for the cache must have shape (B, Hkv, T, D) = "
                                 f"{fmt_shape(want)}; got {fmt_shape(x.shape)} (was the cache made for "
                                 "another batch size or layer?)")
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ShapeError(f"the KV cache is full: it holds {self.length} of max_len = {self.max_len} tokens "
                             f"and cannot take {k.shape[2]} more; make it with new_cache(batch, max_len >= {end})")
        with torch.no_grad():
            self.k[:, :, self.length:end] = k
            self.v[:, :, self.length:end] = v
        return end

    def advance(self, t: int) -> None:
        """Mark ``t`` more tokens as filled."""
        self.length += t

    def reset(self) -> None:
        """Forget every stored token (the memory is reused)."""
        self.length = 0

    def __repr__(self) -> str:
        return f"KVCache({self.length}/{self.max_len} tokens, k {fmt_shape(self.k.shape)}, {self.nbytes} bytes)"


class MultiHeadAttention(nn.Module):
    """Multi-head attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads.

    The options are those of :class:`qkv.nn.MultiHeadAttention`: ``n_kv_heads`` (GQA; 1 is
    MQA; query heads ``h*G .. h*G+G-1`` share kv head h), ``causal`` (bottom-right aligned
    with a cache), ``window`` (``n`` or ``(left, right)``), ``rope`` (half-split, base
    ``rope_base``), ``alibi`` (the paper's slopes), ``bias`` (on all four projections),
    ``scale`` (default ``1/sqrt(d_head)``). :meth:`from_numpy` / :meth:`to_numpy` convert
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
                 rope_base: float = 10000.0, dtype=torch.float32, device=None):
        super().__init__()
        self.d_model, self.n_heads = positive_int("d_model", d_model), positive_int("n_heads", n_heads)
        self.n_kv_heads = self.n_heads if n_kv_heads is None else positive_int("n_kv_heads", n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ShapeError(f"n_heads must be a multiple of n_kv_heads; got n_heads = {n_heads}, "
                             f"n_kv_heads = {n_kv_heads}")
        self.d_head = head_width(self.d_model, self.n_heads, d_head)
        if rope and self.d_head % 2:
            raise ShapeError(f"rope=True needs an even d_head; got d_head = {self.d_head}")
        if isinstance(rope_base, bool) or not isinstance(rope_base, numbers.Real) \
                or not math.isfinite(rope_base) or rope_base <= 1:
            raise ShapeError(f"rope_base must be a finite number > 1 (default 10000); got {rope_base!r}")
        parse_alignment(causal, align)
        parse_window(window)
        parse_chunk(chunk)
        self.causal, self.align, self.window, self.chunk, self.scale = causal, align, window, chunk, scale
        self.rope, self.alibi, self.bias, self.rope_base = bool(rope), bool(alibi), bool(bias), float(rope_base)
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
        if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3) or x.shape[-1] != self.d_model or x.shape[-2] == 0:
            got = fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ShapeError(f"{name} must be a tensor of shape (B, T, d_model) or (T, d_model) with "
                             f"d_model = {self.d_model} and T >= 1; got {got}")
        return (x[None], True) if x.ndim == 2 else (x, False)

    def _split(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = y.shape
        return y.view(b, t, heads, self.d_head).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)

    def forward(self, x, context=None, *, kv_lengths=None, q_lengths=None, cache: KVCache | None = None):
        """Attend from ``x (B, T, d_model)`` to itself, or to ``context (B, Tc, d_model)``.

        ``kv_lengths (B,)``: keys at positions ``>= kv_lengths[b]`` are ignored;
        ``q_lengths (B,)``: rows of ``x`` at or past them are padding (output 0). ``cache``
        (from :meth:`new_cache`, causal self-attention only): the new tokens' keys and values
        are appended and the queries attend to everything stored, bottom-right aligned, with
        RoPE positions starting at the cache length. Returns ``y (B, T, d_model)``.
        """
        x3, squeezed = self._sequences("x", x)
        src = x3
        if context is not None:
            src, c_squeezed = self._sequences("context", context)
            if c_squeezed != squeezed or src.shape[0] != x3.shape[0]:
                raise ShapeError(f"context must have x's batch: x {fmt_shape(x.shape)}, context (B, Tc, d_model) "
                                 f"with B = {x3.shape[0]}; got {fmt_shape(context.shape)}")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ShapeError(f"cache must come from this module's new_cache(batch, max_len); got {type(cache).__name__}")
            if context is not None or not self.causal:
                raise ShapeError("cache= is for causal self-attention decoding (causal=True, no context=)")
        start = cache.length if cache is not None else 0
        q = self._split(self.q_proj(x3), self.n_heads)  # (B,T,d_model) -> (B,Hq,T,D)
        k = self._split(self.k_proj(src), self.n_kv_heads)  # (B,Tk,d_model) -> (B,Hkv,Tk,D)
        v = self._split(self.v_proj(src), self.n_kv_heads)  # (B,Tk,d_model) -> (B,Hkv,Tk,D)
        if self.rope:
            q, k = rope(q, start, self.rope_base), rope(k, start, self.rope_base)
        causal, align = parse_alignment(self.causal, self.align)
        if cache is not None:
            end = cache.write(k, v)
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # this call's keys keep their graph
                k = torch.cat([cache.k[:, :, :start], k], dim=2)  # (B, Hkv, start+T, D)
                v = torch.cat([cache.v[:, :, :start], v], dim=2)
            else:  # decoding: attend to the stored keys in place
                k, v = cache.k[:, :, :end], cache.v[:, :, :end]
            align = "bottom_right"
        out = attention(q, k, v, causal=causal, align=align, window=self.window, chunk=self.chunk,
                        kv_lengths=kv_lengths, q_lengths=q_lengths, alibi=self.alibi_slopes, scale=self.scale,
                        gqa=True)  # (B, Hq, T, D)
        if cache is not None:
            cache.advance(x3.shape[1])
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
                                       dtype=numpy_dtype(self.q_proj.weight.dtype))
        for attr, name in _PROJ:
            w, b = linear_arrays(getattr(self, attr))
            layer.params["W_" + name][...] = w
            if self.bias:
                layer.params["b_" + name][...] = b
        return layer
