"""The kernels that ``method=`` names: each registers once, under a name, with the kernel
interface of :mod:`qkv.kernels.reference` and a word on what it supports.

``qkv.attention(..., method=name)`` looks the name up here (``"auto"`` picks ``"reference"``
or ``"flash"`` by size), and an unknown name is an :class:`~qkv.OptionError` that lists the
registered ones. A new kernel is one :func:`register` call beside its module::

    register(Kernel("flash", flash, makes_weights=False, dense=False, summary="tiled, O(T·D) memory"))
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..errors import OptionError
from . import hidden_keys


@dataclass(frozen=True)
class Kernel:
    """One registered kernel: ``impl`` (a module, or any object) has

    ``forward(q, k, v, spec, scale, group, return_weights=False) -> (out, lse, weights)`` and
    ``backward(dout, q, k, v, out, lse, spec, scale, group, dlse=None) -> (dq, dk, dv)`` on
    checked arrays in the compute dtype, looked up on ``impl`` at each call and guarded by
    :mod:`.hidden_keys` (a NaN or inf in k or v at a key a row may not see never reaches it);
    ``makes_weights``: its forward can return the weights; ``dense``: it holds
    ``(..., Tq, Tk)`` arrays (memory T² per head).
    """

    name: str
    impl: object
    makes_weights: bool
    dense: bool
    summary: str

    @property
    def forward(self) -> Callable:
        return functools.partial(hidden_keys.forward, self.impl)

    @property
    def backward(self) -> Callable:
        return functools.partial(hidden_keys.backward, self.impl)


_KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` under its name (a name is registered once)."""
    if not isinstance(kernel, Kernel):
        raise OptionError(f"register takes a qkv.kernels.registry.Kernel; got {type(kernel).__name__}")
    if not (callable(getattr(kernel.impl, "forward", None)) and callable(getattr(kernel.impl, "backward", None))):
        raise OptionError(f"kernel {kernel.name!r}: impl must have forward and backward; got {kernel.impl!r}")
    if kernel.name in _KERNELS or kernel.name == "auto":
        raise OptionError(f"a kernel named {kernel.name!r} is already registered (or reserved: 'auto')")
    _KERNELS[kernel.name] = kernel
    return kernel


def names() -> tuple:
    """The registered kernels' names, in the order they were registered."""
    return tuple(_KERNELS)


def lookup(method) -> Kernel:
    """The kernel registered as ``method``; an OptionError listing them otherwise."""
    kernel = _KERNELS.get(method) if isinstance(method, str) else None
    if kernel is None:
        listing = ", ".join(f"{n!r} ({k.summary})" for n, k in _KERNELS.items())
        raise OptionError(f"method must be 'auto' or a registered kernel: {listing}; got {method!r}")
    return kernel
