"""The decay forward's four matrix products alone, chunk after chunk from one compiled function
as :func:`qkv.recurrent.decay.compiled.forward_chunks` calls them (``sgemm`` on operands of the
same shapes and layouts), and none of the element-wise work. In one value panel the kernel
makes them as two merged products (:func:`qkv.recurrent.decay.compiled.forward_merged`), so
there it can come in under this bound. :func:`benchmarks.recurrent_suite.decay_products` times this for the
forward where the kernel takes that loop: NumPy's batched products would read each chunk's
operands back from memory, which the loop does not, and could come out slower than the
whole kernel.
"""
from __future__ import annotations

import numpy as np


def loop():
    """``run(q, kT, v, S)`` (float32; ``q (n, Nc, C, Dk)``, ``kT (n, Nc, Dk, C)``, ``v (n, Nc, C, Dv)``,
    ``S (n, p, Dk, w)`` the panels), or None without numba or NumPy's ``sgemm``."""
    from qkv import jit
    mod = jit.load(jit.DECAY)
    if mod is None or not (mod.SGEMM and mod.ILP64):
        return None
    import numba

    from qkv.kernels.blas_compiled import gemm

    @numba.njit(nogil=True)
    def products(addr, q, kT, v, S):
        n, Nc, C, Dk = q.shape
        p, w = S.shape[1], S.shape[3]
        A = np.empty((C, C), np.float32)
        qs = np.empty((p, C, w), np.float32)
        av = np.empty((p, C, w), np.float32)
        nxt = np.empty((p, Dk, w), np.float32)
        for h in range(n):
            for j in range(Nc):
                qj, kt, vj = q[h, j], kT[h, j], v[h, j]
                for a in range(p):
                    gemm(addr, 78, 78, C, w, Dk, qj, S[h, a], 0, qs[a])                     # Q S
                gemm(addr, 78, 78, C, C, Dk, qj, kt, 0, A)                                  # Q Kgᵀ
                for a in range(p):
                    gemm(addr, 78, 78, C, w, C, A, vj[:, a * w:(a + 1) * w], 0, av[a])     # A V
                    gemm(addr, 78, 78, Dk, w, C, kt, vj[:, a * w:(a + 1) * w], 0, nxt[a])  # Kgᵀ V

    addr = (mod.SGEMM, int(mod.ILP64))
    return lambda q, kT, v, S: products(addr, q, kT, v, S)
