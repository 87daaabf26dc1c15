"""The attention kernels behind :func:`qkv.attention`.

Each kernel module has ``forward(q, k, v, spec, scale, group, ...)`` and
``backward(dout, q, k, v, out, lse, spec, scale, group, ...)`` on checked arrays in the
compute dtype (the interface is described in :mod:`qkv.kernels.reference`):

- :mod:`~qkv.kernels.reference`: dense and exact, the oracle every other path is tested against;
- :mod:`~qkv.kernels.flash`: tiled, O(T·D) memory, the fast path;
- :mod:`~qkv.kernels.linear`: linear attention (φ = elu + 1), a different function with its
  own interface (``forward(q, k, v, causal=, offset=, group=, state=)``), behind
  :func:`qkv.linear_attention`.

Kernels register in :mod:`~qkv.kernels.registry` (``method=`` names them); these two here.
"""
from . import flash, reference
from .registry import Kernel, lookup, names, register

register(Kernel("reference", reference, makes_weights=True, dense=True, summary="dense, exact: the oracle"))
register(Kernel("flash", flash, makes_weights=False, dense=False, summary="tiled, O(T·D) memory"))

__all__ = ["Kernel", "lookup", "names", "register"]
