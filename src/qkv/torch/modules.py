"""The texts' ``SelfAttention`` as a PyTorch module on qkv's attention, and the helpers the
modules share (dtype mapping, RoPE on tensors).

The texts' module, parameter for parameter::

    class SelfAttention(nn.Module):
        def __init__(self, d_model, d_k):
            self.W_Q = nn.Linear(d_model, d_k, bias=False)   # and W_K, W_V alike
        def forward(self, x):
            Q, K, V = self.W_Q(x), self.W_K(x), self.W_V(x)
            return softmax(Q Kᵀ / √d_k) V

so a ``state_dict`` (``W_Q.weight``, ``W_K.weight``, ``W_V.weight``, each ``(d_k, d_model)``)
moves between the texts' class and this one unchanged. ``nn.Linear`` stores ``W.T`` of the
NumPy layers' ``x @ W`` convention; :meth:`SelfAttention.from_numpy` and
:meth:`SelfAttention.to_numpy` transpose at that boundary only.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import nn as qnn
from ..errors import ShapeError, fmt_shape, positive_int
from ..nn.checks import check_tokens, mask_options
from .functional import attention

_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
          np.dtype(np.float64): torch.float64}


def torch_dtype(dtype) -> torch.dtype:
    """A NumPy float dtype's torch twin (torch dtypes pass through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ShapeError(f"dtype must be float16, float32 or float64; got {dtype!r}") from None


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """A torch float dtype's NumPy twin (bfloat16 has none: it is refused)."""
    for np_dtype, t in _TORCH.items():
        if t == dtype:
            return np_dtype
    raise ShapeError(f"a NumPy layer needs float16, float32 or float64; got {dtype}")


def rope(x: torch.Tensor, offset=0, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x (..., T, D)`` at positions ``offset .. offset+T-1``, half-split
    pairing, the formula of :func:`qkv.positional.rope` (angles in float64, the rotation in
    float32, float64 for float64), in torch ops so that autograd and ``torch.compile`` see
    through it. ``offset`` is an int, or ints ``(B,)`` (a ragged KV cache: sequence b of
    ``x (B, ..., T, D)`` starts at ``offset[b]``)."""
    t, d = x.shape[-2], x.shape[-1]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    pos = torch.arange(t, dtype=torch.float64)  # (T,)
    if isinstance(offset, (int, np.integer)):
        angle = (offset + pos)[:, None] * theta  # (T, D/2)
    else:  # one start per sequence
        starts = torch.as_tensor(np.asarray(offset), dtype=torch.float64)  # (B,)
        angle = (starts[:, None] + pos)[..., None] * theta  # (B, T, D/2)
        angle = angle.view(angle.shape[0], *([1] * (x.ndim - 3)), t, d // 2)  # (B, 1.., T, D/2)
    cos, sin = torch.cos(angle).to(cdt), torch.sin(angle).to(cdt)
    x1, x2 = x[..., : d // 2].to(cdt), x[..., d // 2:].to(cdt)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)  # (..., T, D)


def copy_linear(linear: nn.Linear, w: np.ndarray, b: np.ndarray | None = None) -> None:
    """Set ``linear`` (``y = x Wᵀ + b``) from a NumPy ``x @ w + b`` pair, checking shapes."""
    want = (linear.in_features, linear.out_features)
    if tuple(w.shape) != want:
        raise ShapeError(f"a weight for nn.Linear({want[0]}, {want[1]}) must have shape (d_in, d_out) = "
                         f"{fmt_shape(want)}; got {fmt_shape(w.shape)}")
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
        if linear.bias is not None and b is not None:
            linear.bias.copy_(torch.from_numpy(np.asarray(b)))


def linear_arrays(linear: nn.Linear) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W, b)`` of ``linear`` in the NumPy layers' ``x @ W + b`` convention (copies)."""
    w = linear.weight.detach().cpu().numpy().T.copy()
    b = None if linear.bias is None else linear.bias.detach().cpu().numpy().copy()
    return w, b


class SelfAttention(nn.Module):
    """The texts' single attention head, ``softmax(Q Kᵀ / √d_k) V``, computed by qkv.

    ``W_Q``, ``W_K``, ``W_V`` are ``nn.Linear(d_model, d_k, bias=False)`` exactly as in the
    texts' class, so their ``state_dict`` loads into each other. ``d_v`` (default ``d_k``)
    and ``causal`` (as in :func:`qkv.attention`) are the NumPy layer's options.

    >>> import torch
    >>> layer = SelfAttention(2, 2)
    >>> with torch.no_grad():
    ...     for w in (layer.W_Q, layer.W_K, layer.W_V): _ = w.weight.copy_(torch.eye(2))
    >>> layer(torch.tensor([[1., 0.], [0., 1.], [1., 1.]])).detach().numpy().round(3)  # the texts' §5
    array([[0.802, 0.599],
           [0.599, 0.802],
           [0.752, 0.752]], dtype=float32)
    """

    def __init__(self, d_model: int, d_k: int, *, d_v: int | None = None, causal=False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.d_model, self.d_k = positive_int("d_model", d_model), positive_int("d_k", d_k)
        self.d_v = self.d_k if d_v is None else positive_int("d_v", d_v)
        mask_options(causal)  # the NumPy layer's check: a bad value fails here, not at the first forward
        self.causal = causal
        kw = dict(bias=False, dtype=torch_dtype(dtype), device=device)
        self.W_Q = nn.Linear(self.d_model, self.d_k, **kw)
        self.W_K = nn.Linear(self.d_model, self.d_k, **kw)
        self.W_V = nn.Linear(self.d_model, self.d_v, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., T, d_model) -> (..., T, d_v)``."""
        check_tokens("x", tuple(x.shape), self.d_model)
        q, k, v = self.W_Q(x), self.W_K(x), self.W_V(x)  # (..., T, d_k), (..., T, d_k), (..., T, d_v)
        return attention(q, k, v, causal=self.causal)  # (..., T, d_v)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}, causal={self.causal!r}"

    @classmethod
    def from_numpy(cls, layer: qnn.SelfAttention) -> "SelfAttention":
        """This module with the weights and options of a :class:`qkv.nn.SelfAttention`."""
        if not isinstance(layer, qnn.SelfAttention):
            raise ShapeError(f"layer must be a qkv.nn.SelfAttention; got {type(layer).__name__}")
        mod = cls(layer.d_model, layer.d_k, d_v=layer.d_v, causal=layer.causal, dtype=torch_dtype(layer.dtype))
        for name in ("W_Q", "W_K", "W_V"):
            copy_linear(getattr(mod, name), layer.params[name])
        return mod

    def to_numpy(self) -> qnn.SelfAttention:
        """A :class:`qkv.nn.SelfAttention` with this module's weights and options."""
        layer = qnn.SelfAttention(self.d_model, self.d_k, d_v=self.d_v, causal=self.causal,
                                  dtype=numpy_dtype(self.W_Q.weight.dtype))
        for name in ("W_Q", "W_K", "W_V"):
            layer.params[name][...] = linear_arrays(getattr(self, name))[0]
        return layer
