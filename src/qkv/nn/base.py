"""What every qkv.nn layer shares: named parameters and gradients, init, train/eval, input checks.

A layer holds ``params`` and ``grads``, two dicts of NumPy arrays with the same keys and
shapes. ``forward(...)`` keeps what the backward needs on the layer; ``backward(dy)``
*overwrites* ``grads`` with the gradient of the loss for that one forward call and returns
the gradient for the input(s). An optimizer (:class:`qkv.nn.Adam`) reads both dicts.

A layer built from sublayers (the attention layers project through :class:`qkv.nn.Linear`)
shows their arrays in its own flat ``params``/``grads`` under its own names (``W_Q`` is
the ``W`` of the query projection): reading, writing in place and assigning a new array
to a name all reach the sublayer, so checkpoints and optimizers see one dict per layer.

**Training and inference.** As in PyTorch, a layer starts in training mode
(``layer.training`` is True); ``layer.eval()`` switches it and its sublayers to inference
and ``layer.train()`` back (both return the layer). The layers have no dropout or batch
statistics, so eval mode changes memory only: its forward returns the same numbers but
keeps nothing for backward (what ``torch.inference_mode()`` does), and drops whatever an
earlier forward kept. ``backward`` after such a forward raises a RuntimeError saying so.
"""
from __future__ import annotations

import math
from collections.abc import MutableMapping

import numpy as np

from ..errors import ShapeError, as_float_array
from . import products
from .checks import check_sequences

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


class SublayerArrays(MutableMapping):
    """A flat dict view ``{name: array}`` over sublayers' ``params`` (or ``grads``).

    ``links[name] = (sublayer, key)``: ``view[name]`` is ``sublayer.<kind>[key]``, and
    ``view[name] = array`` puts the array there (no copy). The names are fixed.
    """

    def __init__(self, kind: str, links: dict):
        self._kind, self._links = kind, links

    def _where(self, name: str) -> tuple[dict, str]:
        if name not in self._links:
            raise KeyError(f"{name!r} is not one of this layer's {self._kind}: {list(self._links)}")
        layer, key = self._links[name]
        return getattr(layer, self._kind), key

    def __getitem__(self, name: str) -> np.ndarray:
        store, key = self._where(name)
        return store[key]

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        store, key = self._where(name)
        store[key] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"the {self._kind} of a layer cannot be removed; got del [{name!r}]")

    def __iter__(self):
        return iter(self._links)

    def __len__(self) -> int:
        return len(self._links)

    def __repr__(self) -> str:
        return repr(dict(self))


class Layer:
    """Base of the trainable layers: ``params``/``grads`` dicts, dtype, a Generator, train/eval."""

    def __init__(self, *, dtype=np.float32, rng: np.random.Generator | None = None):
        dtype = np.dtype(dtype)
        if dtype not in [np.dtype(t) for t in FLOAT_DTYPES]:
            raise ShapeError(f"dtype must be float16, float32 or float64; got {dtype}")
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise ShapeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)); got {type(rng).__name__}")
        self._sublayers: list[Layer] = []
        self.dtype = dtype
        self.rng = rng if rng is not None else np.random.default_rng()
        self.params: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.training = True
        self._saved = None  # what forward kept for backward
        self._inference_forward = False  # the last forward ran in eval mode

    @property
    def dtype(self) -> np.dtype:
        """Parameter and compute dtype; setting it sets the sublayers' too (inputs are cast to it)."""
        return self._dtype

    @dtype.setter
    def dtype(self, value) -> None:
        self._dtype = np.dtype(value)
        for layer in self._sublayers:
            layer.dtype = value

    def _add(self, name: str, shape: tuple, *, std: float | None = None, zero: bool = False) -> None:
        """Register parameter ``name``: normal(0, std) (default 1/sqrt(fan_in)) or zeros."""
        if zero:
            value = np.zeros(shape, dtype=self.dtype)
        else:
            std = 1.0 / math.sqrt(shape[0]) if std is None else std
            value = (self.rng.standard_normal(shape) * std).astype(self.dtype)
        self.params[name] = value
        self.grads[name] = np.zeros_like(value)

    def _expose(self, links: dict[str, tuple[Layer, str]]) -> None:
        """Make ``params``/``grads`` flat views: ``links[name] = (sublayer, its key)``, in order."""
        self._sublayers = list(dict.fromkeys(layer for layer, _ in links.values()))
        self.params = SublayerArrays("params", links)
        self.grads = SublayerArrays("grads", links)

    def zero_grad(self) -> None:
        """Set every gradient to 0."""
        for g in self.grads.values():
            g[...] = 0

    @property
    def n_params(self) -> int:
        """Number of scalar parameters."""
        return int(sum(p.size for p in self.params.values()))

    # --- training / inference ------------------------------------------------------------
    def train(self, mode: bool = True):
        """Training mode (``mode=True``, the default state) or inference (False); returns self."""
        self.training = bool(mode)
        for layer in self._sublayers:
            layer.train(mode)
        return self

    def eval(self):
        """Inference mode, ``train(False)``: forward keeps nothing for backward. Returns self."""
        return self.train(False)

    def _keep(self, saved) -> None:
        """Hold ``saved`` for backward in training mode; in eval mode hold nothing at all."""
        self._saved = saved if self.training else None
        self._inference_forward = not self.training

    def _forget(self) -> None:
        """Drop what the last forward kept, here and in every sublayer."""
        self._saved = None
        for layer in self._sublayers:
            layer._forget()

    def _need_saved(self):
        if self._saved is None:
            name = type(self).__name__
            if self._inference_forward:
                raise RuntimeError(f"{name}.backward needs a forward in training mode: the last forward ran "
                                   "in eval() mode, which keeps nothing for backward (call layer.train() first)")
            raise RuntimeError(f"{name}.backward needs a forward call first")
        return self._saved


def check_input(name: str, x, d_model: int, *, batch_first: bool = True,
                empty: bool = False) -> tuple[np.ndarray, bool]:
    """``x`` as a float array ``(B, T, d_model)``; a 2-D ``(T, d_model)`` gets B = 1; T = 0 only
    with ``empty``.

    Returns ``(x3, squeezed)`` where ``squeezed`` says the caller gave 2-D.
    """
    x = as_float_array(name, x)
    squeezed = check_sequences(name, x.shape, d_model, empty=empty)
    x = x[None] if squeezed else x
    return x, squeezed


def linear_grad(x: np.ndarray, dy: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``dW`` of ``y = x @ W`` summed over every leading axis: ``(..., n) , (..., m) -> (n, m)``,
    written into ``out`` when given (a layer's grads array: no temporary and copy)."""
    # (n, N) @ (N, m) -> (n, m)
    return products.matmul(x.reshape(-1, x.shape[-1]).T, dy.reshape(-1, dy.shape[-1]), out=out)


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """``(B, T, H*Dh) -> (B, H, T, Dh)``."""
    b, t, hd = x.shape
    return x.reshape(b, t, n_heads, hd // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(B, H, T, Dh) -> (B, T, H*Dh)``."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)
