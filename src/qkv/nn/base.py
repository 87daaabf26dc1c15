"""What every qkv.nn layer shares: named parameters and gradients, init, input checks.

A layer holds ``params`` and ``grads``, two dicts of NumPy arrays with the same keys and
shapes. ``forward(...)`` keeps what the backward needs on the layer; ``backward(dy)``
*overwrites* ``grads`` with the gradient of the loss for that one forward call and returns
the gradient for the input(s). An optimizer (:class:`qkv.nn.Adam`) reads both dicts.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError, as_float_array, fmt_shape, positive_int

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


class Layer:
    """Base of the trainable layers: ``params``/``grads`` dicts, dtype, a Generator."""

    def __init__(self, *, dtype=np.float32, rng: np.random.Generator | None = None):
        dtype = np.dtype(dtype)
        if dtype not in [np.dtype(t) for t in FLOAT_DTYPES]:
            raise ShapeError(f"dtype must be float16, float32 or float64; got {dtype}")
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise ShapeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)); got {type(rng).__name__}")
        self.dtype = dtype
        self.rng = rng if rng is not None else np.random.default_rng()
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self._saved = None  # what forward kept for backward

    def _add(self, name: str, shape: tuple, *, std: float | None = None, zero: bool = False) -> None:
        """Register parameter ``name``: normal(0, std) (default 1/sqrt(fan_in)) or zeros."""
        if zero:
            value = np.zeros(shape, dtype=self.dtype)
        else:
            std = 1.0 / math.sqrt(shape[0]) if std is None else std
            value = (self.rng.standard_normal(shape) * std).astype(self.dtype)
        self.params[name] = value
        self.grads[name] = np.zeros_like(value)

    def zero_grad(self) -> None:
        """Set every gradient to 0."""
        for g in self.grads.values():
            g[...] = 0

    @property
    def n_params(self) -> int:
        """Number of scalar parameters."""
        return int(sum(p.size for p in self.params.values()))

    def _need_saved(self):
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward needs a forward call first")
        return self._saved


def head_width(d_model: int, n_heads: int, d_head) -> int:
    """``d_head`` if given, else ``d_model // n_heads`` (which must then divide evenly)."""
    if d_head is None:
        if d_model % n_heads:
            raise ShapeError(f"d_model must be a multiple of n_heads (or pass d_head=); got "
                             f"d_model = {d_model}, n_heads = {n_heads}")
        d_head = d_model // n_heads
    return positive_int("d_head", d_head)


def check_input(name: str, x, d_model: int, *, batch_first: bool = True) -> tuple[np.ndarray, bool]:
    """``x`` as a float array ``(B, T, d_model)``; a 2-D ``(T, d_model)`` gets B = 1.

    Returns ``(x3, squeezed)`` where ``squeezed`` says the caller gave 2-D.
    """
    x = as_float_array(name, x)
    if x.ndim == 2:
        x, squeezed = x[None], True
    elif x.ndim == 3:
        squeezed = False
    else:
        raise ShapeError(f"{name} must have shape (B, T, d_model) or (T, d_model) with d_model = {d_model}; "
                         f"got {fmt_shape(x.shape)}")
    if x.shape[-1] != d_model:
        raise ShapeError(f"{name} must have shape (B, T, d_model) = (..., {d_model}); got {fmt_shape(x.shape)}")
    if x.shape[1] == 0:
        raise ShapeError(f"{name} must have T >= 1; got {fmt_shape(x.shape)}")
    return x, squeezed


def linear_grad(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """``dW`` of ``y = x @ W`` summed over every leading axis: ``(..., n) , (..., m) -> (n, m)``."""
    return x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])  # (n, N) @ (N, m) -> (n, m)


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """``(B, T, H*Dh) -> (B, H, T, Dh)``."""
    b, t, hd = x.shape
    return x.reshape(b, t, n_heads, hd // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(B, H, T, Dh) -> (B, T, H*Dh)``."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)
