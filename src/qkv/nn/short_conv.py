"""Zoology's BaseConv and the conv-then-attention mixer of its MQAR "attention" models.

**BaseConv** (Arora et al. 2023, ``zoology.mixers.base_conv.BaseConv``), on ``u (B, T, C)``::

    c = conv(u)                    short causal depthwise convolution, K taps and a bias per channel
    p = u W_proj + b_proj          (B, T, C) @ (C, C) -> (B, T, C)
    y = c ∘ p + u

The convolution is the one the recurrent layers use (:func:`~qkv.nn.recurrent_parts.conv_forward`:
position t sees inputs ``t-K+1 .. t``, zeros before the sequence). Backward, each step of the
forward reversed::

    dc = dy ∘ p,   dp = dy ∘ c
    dW_proj = uᵀ dp,   db_proj = Σ dp
    du = dy + dp W_projᵀ + conv'(dc)

**ConvAttention** is Zoology's ``Hybrid([BaseConv, MHA])``: ``attn(conv(x))``, in the block's
pre-norm residual branch ``x + attn(conv(ln_1(x)))``. The convolution hands each position its
K - 1 predecessors, so the attention has only to match contents (MQAR's key -> value binding).

**Decoding.** Its cache, :class:`ConvKVCache`, is the attention's :class:`~qkv.nn.KVCache` plus
``conv (B, K-1, C)``: each sequence's last K - 1 inputs of the convolution. A right-padded call
(``q_lengths``) keeps, for sequence b, the K - 1 inputs that end at its own last real row.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError, positive_int
from .base import Layer, check_input, linear_grad
from .cache import KVCache
from .multihead import MultiHeadAttention
from .products import matmul
from .recurrent_parts import compute_dtype, conv_backward, conv_forward, grad_output


class BaseConv(Layer):
    """``y = conv(u) ∘ (u W_proj + b_proj) + u`` on ``(B, T, d_model)``; ``kernel`` taps (K >= 1).

    Parameters: ``W_proj (C, C)``, ``b_proj (C,)``, ``conv_weight (C, K)``, ``conv_bias (C,)``;
    the taps and their bias drawn uniform in ``±1/sqrt(K)`` (PyTorch's ``Conv1d`` default), the
    projection normal(0, 1/sqrt(C)) and its bias 0.
    """

    def __init__(self, d_model: int, kernel: int = 3, *, dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model, self.kernel = positive_int("d_model", d_model), positive_int("kernel", kernel)
        C, K = self.d_model, self.kernel
        self._add("W_proj", (C, C))
        self._add("b_proj", (C,), zero=True)
        bound = 1.0 / math.sqrt(K)
        for name, shape in (("conv_weight", (C, K)), ("conv_bias", (C,))):
            self._add(name, shape, zero=True)
            self.params[name][...] = self.rng.uniform(-bound, bound, shape)

    def _p(self, name: str) -> np.ndarray:
        return self.params[name].astype(compute_dtype(self.dtype), copy=False)

    def forward(self, x, *, window: np.ndarray | None = None, counts=None) -> np.ndarray:
        """``x (B, T, d_model)`` (or ``(T, d_model)``) -> the same shape.

        ``window (B, K-1, d_model)``: the inputs before x (None: zeros, a sequence's start);
        updated in place to the last K - 1 inputs ending at row ``counts[b] - 1`` of sequence b
        (``counts (B,)``, default all T: the right-padded rows after them are not kept).
        """
        x3, squeezed = check_input("x", x, self.d_model)
        u = x3.astype(compute_dtype(self.dtype), copy=False)
        B, T, C = u.shape
        K = self.kernel
        if window is not None and window.shape != (B, K - 1, C):
            raise ShapeError(f"window must have shape (B, K-1, d_model) = ({B}, {K - 1}, {C}); got {window.shape}")
        c, padded = conv_forward(u, self._p("conv_weight"), self._p("conv_bias"), window)  # (B, T, C), (B, K-1+T, C)
        p = matmul(u.reshape(-1, C), self._p("W_proj")) + self._p("b_proj")           # (BT,C) @ (C,C) -> (BT,C)
        p = p.reshape(B, T, C)
        y = c * p + u
        if window is not None and K > 1:
            ends = np.full(B, T) if counts is None else np.asarray(counts)
            for b in range(B):                        # ũ rows counts[b] .. counts[b]+K-2: the last K-1 real inputs
                window[b] = padded[b, ends[b]:ends[b] + K - 1]
        self._keep(dict(u=u, padded=padded, c=c, p=p, squeezed=squeezed))
        y = y.astype(self.dtype, copy=False)
        return y[0] if squeezed else y

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy`` (the output's shape); return ``dx``."""
        s = self._need_saved()
        u, c, p = s["u"], s["c"], s["p"]
        dy = grad_output(dy, u.shape, s["squeezed"]).astype(u.dtype, copy=False)
        dc, dp = dy * p, dy * c                                                      # (B, T, C) each
        self.grads["W_proj"][...] = linear_grad(u, dp)                              # (C,BT) @ (BT,C) -> (C,C)
        self.grads["b_proj"][...] = dp.sum(axis=(0, 1))
        du_conv, self.grads["conv_weight"][...], self.grads["conv_bias"][...] = conv_backward(
            dc, s["padded"], self._p("conv_weight"))
        du = dy + matmul(dp.reshape(-1, u.shape[-1]), self._p("W_proj").T).reshape(u.shape) + du_conv  # (BT,C) @ (C,C)
        du = du.astype(self.dtype, copy=False)
        return du[0] if s["squeezed"] else du


class ConvKVCache(KVCache):
    """A :class:`~qkv.nn.KVCache` and ``conv (B, K-1, d_model)``, the last K - 1 inputs of each
    sequence's convolution (zeros before its first token); ``window``: the attention's kept keys."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, d_head: int, d_model: int, kernel: int,
                 dtype=np.float32, *, window: int | None = None):
        super().__init__(batch, n_kv_heads, max_len, d_head, dtype, window=window)
        self.conv = np.zeros((self.batch, kernel - 1, d_model), compute_dtype(dtype))

    @property
    def nbytes(self) -> int:
        return int(super().nbytes + self.conv.nbytes)

    def reset(self) -> None:
        super().reset()
        self.conv[...] = 0


class ConvAttention(Layer):
    """``attn(short_conv(x))``: a :class:`BaseConv` of ``kernel`` taps, then an attention layer
    (a causal :class:`~qkv.nn.MultiHeadAttention` or one called as it is); Zoology's
    ``Hybrid([BaseConv, MHA])``.

    Parameters: ``short_conv.<BaseConv's names>`` then the attention's own (``W_Q``, ...).
    ``forward(x, cache=, q_lengths=, kv_lengths=)`` as the attention layer's; ``new_cache``
    gives a :class:`ConvKVCache`.
    """

    def __init__(self, attn: Layer, kernel: int = 3, *, rng: np.random.Generator | None = None):
        if not isinstance(attn, MultiHeadAttention):
            raise ShapeError(f"attn must be a qkv.nn.MultiHeadAttention (or a subclass); got {type(attn).__name__}")
        super().__init__(dtype=attn.dtype, rng=rng)
        self.d_model = attn.d_model
        self.short_conv = BaseConv(attn.d_model, kernel, dtype=attn.dtype, rng=self.rng)
        self.attn = attn
        links = {f"short_conv.{n}": (self.short_conv, n) for n in self.short_conv.params}
        links.update({n: (attn, n) for n in attn.params})
        self._expose(links)

    @property
    def kernel(self) -> int:
        return self.short_conv.kernel

    def new_cache(self, batch: int, max_len: int) -> ConvKVCache:
        """An empty :class:`ConvKVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        a = self.attn
        return ConvKVCache(batch, a.n_kv_heads, max_len, a.d_head, self.d_model, self.kernel, a.dtype,
                           window=a.kept_keys())

    def forward(self, x, *, cache: ConvKVCache | None = None, q_lengths=None, kv_lengths=None) -> np.ndarray:
        """``x (B, T, d_model) -> (B, T, d_model)``; ``cache``, ``q_lengths``, ``kv_lengths`` as
        :meth:`qkv.nn.MultiHeadAttention.forward`. A failed call leaves the cache as it was."""
        if cache is not None and not isinstance(cache, ConvKVCache):
            raise ShapeError(f"cache must come from this layer's new_cache(batch, max_len) (a ConvKVCache); "
                             f"got {type(cache).__name__}")
        window = counts = None
        if cache is not None:
            x3, _ = check_input("x", x, self.d_model)
            counts = cache.counts(x3.shape[1], q_lengths)
            window = cache.conv.copy()
        h = self.short_conv.forward(x, window=window, counts=counts)
        kw = {k: v for k, v in (("cache", cache), ("q_lengths", q_lengths), ("kv_lengths", kv_lengths))
              if v is not None}
        y = self.attn.forward(h, **kw)
        if cache is not None:
            cache.conv[...] = window                  # only once the attention's cache took the step
        return y

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy``; return ``dx`` (after a cached forward, earlier tokens are constants)."""
        return self.short_conv.backward(self.attn.backward(dy))
