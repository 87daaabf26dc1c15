"""The row kernel: attention over up to :data:`MAX_KEYS` keys, a query row a pass, for the
short sequences people train and serve (``method="auto"`` takes it; see :func:`qkv.api.choose_kernel`).

- :mod:`.kernel`: what it takes (:func:`applies`), its work units and row blocks, and the
  ``forward`` / ``backward`` with the kernel interface of :mod:`qkv.kernels.reference`;
- :mod:`.fused`: a call's every head in one compiled parallel loop, BLAS called from it (the
  ``fast`` extra);
- :mod:`.compiled`: the numba passes over a query row (forward and backward);
- :mod:`.numpy_rows`: the same kernel in NumPy, where the fast extra is not installed.

Its oracle is :mod:`qkv.kernels.reference`, beside it in :mod:`qkv.kernels`.
"""
from .kernel import (BLOCK_ROWS, COPY_T_KEYS, MAX_KEYS, SERIAL_WORK, SHORT_ROWS, UNIT_ENTRIES, applies,
                     backward, forward, key_runs, row_blocks, stackable)

__all__ = ["applies", "stackable", "key_runs", "row_blocks", "forward", "backward", "MAX_KEYS",
           "UNIT_ENTRIES", "SERIAL_WORK", "BLOCK_ROWS", "SHORT_ROWS", "COPY_T_KEYS"]
