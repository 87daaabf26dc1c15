"""The products-only bound: qkv's matrix products alone, on qkv's tiles and threads.

The tiled kernel's time is its matrix products (OpenBLAS) plus its element-wise work (the
exponential, sums, masks). This runs only the products, in the kernel's own schedule and
tile shapes, on the same number of threads with BLAS held to one thread each, so that

    torch time / products time

is the most the qkv/torch ratio could be if everything but the products cost nothing: a
bound measured on this machine in the same run, not a guess. Forward, per (head, row block
of 512): ``S = K_c Qᵀ`` and ``O += Sᵀ V_c`` over key chunks of 1024 (causal: the keys before
the block, then the diagonal by 128-row pieces, as the kernel does). Backward, per (head, key
block of 1024) and 256-row tile: ``S``, ``dP = V dOᵀ``, ``dV += P dO``, ``dK += dS Q``,
``dQ += dSᵀ K`` (causal: the rows at or after the key block). Inputs ``(B, H, T, D)``,
self-attention (Tq = Tk), no GQA.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

ROWS, KEYS, DIAGONAL, BWD_ROWS = 512, 1024, 128, 256


def _buffers(local, shape):
    """This thread's two score-sized buffers (reused tile after tile, as the kernel's scratch is)."""
    import numpy as np
    if getattr(local, "shape", None) != shape:
        local.shape, local.a, local.b = shape, np.empty(shape, np.float32), np.empty(shape, np.float32)
    return local.a, local.b


def _forward_jobs(q, k, v, causal, local):
    import numpy as np
    b, h, t, d = q.shape
    out = np.zeros_like(q)

    def block(i, j, r0, r1):
        qs, kk, vv, o = q[i, j, r0:r1], k[i, j], v[i, j], out[i, j, r0:r1]
        buf = _buffers(local, (KEYS * ROWS,))[0]
        pieces = [(r0, r1, 0, r0 if causal else t)]
        if causal:
            pieces += [(p0, min(p0 + DIAGONAL, r1), r0, min(p0 + DIAGONAL, r1)) for p0 in range(r0, r1, DIAGONAL)]
        for p0, p1, a, e in pieces:
            for c in range(a, e, KEYS):
                w = min(c + KEYS, e) - c
                s = buf[:w * (p1 - p0)].reshape(w, p1 - p0)
                np.matmul(kk[c:c + w], qs[p0 - r0:p1 - r0].T, out=s)  # (w, D) @ (D, r)
                o[p0 - r0:p1 - r0] += s.T @ vv[c:c + w]             # (r, w) @ (w, D)

    return [lambda i=i, j=j, r0=r0: block(i, j, r0, min(r0 + ROWS, t))
            for i in range(b) for j in range(h) for r0 in range(0, t, ROWS)], out


def _backward_jobs(q, k, v, dout, causal, local):
    import numpy as np
    b, h, t, d = q.shape

    def block(i, j, c0, c1):
        qq, kk, vv, do = q[i, j], k[i, j, c0:c1], v[i, j, c0:c1], dout[i, j]
        dk, dv = np.zeros_like(kk), np.zeros_like(vv)
        pa, pb = _buffers(local, (KEYS * ROWS,))
        if getattr(local, "dq", None) is None or local.dq.shape != q.shape:
            local.dq = np.zeros_like(q)  # each thread its own dQ, as the kernel's lanes have
        dq = local.dq
        for r0 in range(c0 if causal else 0, t, BWD_ROWS):
            r1 = min(r0 + BWD_ROWS, t)
            p = pa[:(c1 - c0) * (r1 - r0)].reshape(c1 - c0, r1 - r0)
            ds = pb[:(c1 - c0) * (r1 - r0)].reshape(c1 - c0, r1 - r0)
            np.matmul(kk, qq[r0:r1].T, out=p)    # S, then P: (w, r)
            np.matmul(vv, do[r0:r1].T, out=ds)   # dP, then dS: (w, r)
            dv += p @ do[r0:r1]
            dk += ds @ qq[r0:r1]
            dq[i, j, r0:r1] += ds.T @ kk
        return dk, dv

    return [lambda i=i, j=j, c0=c0: block(i, j, c0, min(c0 + KEYS, t))
            for i in range(b) for j in range(h) for c0 in range(0, t, KEYS)]


def runner(q, k, v, dout, *, causal: bool, backward: bool, threads: int):
    """A no-argument callable running the products of one forward (and backward)."""
    from qkv.threads import blas_one_thread

    import threading
    local = threading.local()

    def run():
        jobs = _forward_jobs(q, k, v, causal, local)[0]
        jobs += _backward_jobs(q, k, v, dout, causal, local) if backward else []
        with blas_one_thread(), ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda job: job(), jobs))
    return run
