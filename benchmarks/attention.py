"""What one attention case runs and counts: inputs, the callables of each method, FLOP and bytes.

Methods, each a no-argument callable over the same inputs:

- ``qkv``: ``qkv.attention(..., method="flash")`` and ``qkv.attention_backward``;
- ``dense``: the same calls with ``method="reference"`` (softmax(QKᵀ)V, T² memory);
- ``auto``: the same calls with ``method="auto"`` (what a user gets; the shapes suite);
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` and autograd (the caller
  sets ``torch.set_num_threads`` to qkv's thread count).

FLOP convention (written once, here, and used for every GFLOP/s printed)::

    forward          F = 4 · B · Hq · Tq · Tk · D      (QKᵀ and PV, 2 FLOP per multiply-add)
    causal forward   F / 2                              (half the score matrix is visible)
    backward         2.5 · F                            (five products instead of two)
    forward+backward 3.5 · F

Decoding (Tq = 1) is memory-bound and reported as GB/s of K and V read,
``B · Hkv · Tk · (D + Dv) · 4`` bytes per call, next to the machine's copy bandwidth
measured in the same loop: ``np.copyto`` of as many bytes as K and V, split over the same
threads (the JSON keeps it as STREAM counts a copy, bytes read + written; the table shows
bytes copied a second, and qkv/copy holds the decode's reads against that).

The main suite also times :mod:`.products`: qkv's matrix products alone, the bound on what
any softmax could leave.
"""
from __future__ import annotations

METHODS = ("qkv", "dense", "torch")


def forward_flops(b, hq, tq, tk, d, causal):
    """4·B·Hq·Tq·Tk·D, halved when causal."""
    f = 4.0 * b * hq * tq * tk * d
    return f / 2 if causal else f


def fwd_bwd_flops(b, hq, tq, tk, d, causal):
    """Forward plus backward, the backward counted as 2.5 forwards."""
    return 3.5 * forward_flops(b, hq, tq, tk, d, causal)


def kv_bytes(b, hkv, tk, d, dv, itemsize=4):
    """Bytes of K (B, Hkv, Tk, D) and V (B, Hkv, Tk, Dv): what one decoding step must read."""
    return b * hkv * tk * (d + dv) * itemsize


def inputs(rng, b, hq, hkv, tq, tk, d):
    """float32 ``q (B,Hq,Tq,D), k (B,Hkv,Tk,D), v (B,Hkv,Tk,D), dout (B,Hq,Tq,D)``, standard normal."""
    import numpy as np
    q = rng.standard_normal((b, hq, tq, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, tk, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, tk, d), dtype=np.float32)
    dout = rng.standard_normal((b, hq, tq, d), dtype=np.float32)
    return q, k, v, dout


def runner(method, q, k, v, dout, *, causal, backward, gqa=False, **options):
    """A no-argument callable doing one forward (and backward) by ``method``; ``options``:
    more keywords of qkv.attention (softcap, dropout) for qkv's methods."""
    if method == "torch":
        return _torch_runner(q, k, v, dout, causal=causal, backward=backward, gqa=gqa)

    import qkv
    name = {"qkv": "flash", "dense": "reference", "auto": "auto"}[method]
    if not backward:
        return lambda: qkv.attention(q, k, v, causal=causal, gqa=gqa, method=name, **options)

    def fwd_bwd():
        out, lse = qkv.attention(q, k, v, causal=causal, gqa=gqa, return_lse=True, method=name, **options)
        return qkv.attention_backward(dout, q, k, v, out, lse, causal=causal, gqa=gqa, method=name, **options)
    return fwd_bwd


def _torch_runner(q, k, v, dout, *, causal, backward, gqa):
    import torch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tq_, tk_, tv_ = (torch.from_numpy(x) for x in (q, k, v))
    if not backward:
        def fwd():
            with torch.no_grad():
                return sdpa(tq_, tk_, tv_, is_causal=bool(causal), enable_gqa=gqa)
        return fwd
    tq_, tk_, tv_ = (x.clone().requires_grad_(True) for x in (tq_, tk_, tv_))
    tdo = torch.from_numpy(dout)

    def fwd_bwd():
        for x in (tq_, tk_, tv_):
            x.grad = None
        out = sdpa(tq_, tk_, tv_, is_causal=bool(causal), enable_gqa=gqa)
        out.backward(tdo)
        return tq_.grad
    return fwd_bwd


def copier(nbytes: int, threads: int):
    """A callable copying ``nbytes`` (float32) with ``np.copyto`` split over ``threads``
    threads: the machine's copy bandwidth, timed alongside the decoding it is compared to.
    Call its ``close()`` when done (it holds a thread pool)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    cuts = np.linspace(0, n, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    pool = ThreadPoolExecutor(threads)
    copy = lambda: list(pool.map(lambda p: np.copyto(*p), parts))  # noqa: E731
    copy.close = lambda: pool.shutdown(wait=True)
    return copy
