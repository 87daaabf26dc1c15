"""Exact attention in tiles: online-softmax forward and a backward that recomputes P from lse.

O(T·D) memory: no ``(Tq, Tk)`` array is ever made. The derivations live with the code:

- :mod:`.forward_kernel`: softmax with any offset, the online softmax (the exact path) and
  the fixed offset from a Cauchy–Schwarz bound (the fast path), in base 2;
- :mod:`.backward_kernel`: ``dV = Pᵀ dO``, ``dS = P ∘ (dP - delta)``, ``dQ``, ``dK`` with
  the subtractions folded into the products, and delta from the tiles' own P where a row
  has one dominant key; :mod:`.operands`: a call's prepared operands;
- :mod:`.precise`: which rows take the precise path (float64 scores), and the sums the
  backward normalises them by;
- :mod:`.tiles`: the :class:`Tiles` sizes of a call, its threads, scratch buffers and masks;
- :mod:`.products`: a tile's two products, BLAS's or, for decoding rows, K and V read once;
- :mod:`.exp2`: the exponential of the score tiles, the one element-wise pass that decides
  the speed: compiled (the ``fast`` extra) or NumPy's fastest on this CPU (``EXP_PATH()``);
- :mod:`.compiled`: the numba passes of the ``fast`` extra (loaded by :func:`qkv.jit.flash`);
- :mod:`.bound_tiles`: the fast path's tiles, a task's all in one compiled call
  (:mod:`.task_compiled`) where that makes the same bits, else one by one.

``forward`` and ``backward`` have the kernel interface of :mod:`qkv.kernels.reference`,
plus ``tiles=`` and ``num_threads=`` for the one call.
"""
from .backward_kernel import backward, delta_residual, peaked_rows, row_sums
from .exp2 import path as EXP_PATH
from .forward_kernel import forward
from .precise import RowNorm, key_norm_max, precise_rows
from .tiles import Tiles

__all__ = ["forward", "backward", "Tiles", "EXP_PATH", "RowNorm", "key_norm_max", "precise_rows", "row_sums",
           "delta_residual", "peaked_rows"]
