"""``qkv bench --suite shapes``: qkv (``method="auto"``) against PyTorch SDPA at the shapes
people train and serve: short sequences in big batches, many heads.

Shapes ``(B, H, T, D)``, float32, self-attention (Tq = Tk = T, Hq = Hkv = H):

- (12, 4, 64, 32): nanoGPT's CPU recipe;
- (64, 6, 256, 64): nanoGPT's GPU recipe;
- (1, 8, 256, 16): a small model, one sequence;
- (8, 12, 1024, 64): GPT-2 small, batch 8;
- (32, 8, 128, 64), (16, 12, 192, 64), (4, 16, 512, 128): serving batches.

Each shape runs causal and not, forward and forward+backward; the two sides are
``qkv.attention`` (+ ``qkv.attention_backward``) with ``method="auto"`` (what a user gets) and
``torch.nn.functional.scaled_dot_product_attention`` (+ autograd), same threads, same inputs
(the tensors share the arrays' memory). Timing: ``timing.rounds``, the sides alternating
and the first side rotating from repeat to repeat, medians reported; the ratio is the median
over repeats of torch time ÷ qkv time within a repeat (above 1, qkv is faster).

FLOP convention (as in ``attention.py``): forward ``4·B·H·T²·D``, halved when causal;
forward+backward 3.5 times the forward.

``bound`` (where the fast extra runs): torch time ÷ the time of qkv's same call with the row
kernel's element-wise passes left out (:func:`products_only`): its products, transposed
copies, Python and thread hand-offs alone, as ``--suite main``'s bound is its products alone.
It is the most torch ÷ qkv could be if the exponential, the sums and the masks cost nothing.
"""
from __future__ import annotations

import statistics

from .attention import forward_flops, fwd_bwd_flops, inputs, runner
from .timing import rounds

FULL = ((12, 4, 64, 32), (64, 6, 256, 64), (1, 8, 256, 16), (8, 12, 1024, 64),
        (32, 8, 128, 64), (16, 12, 192, 64), (4, 16, 512, 128))
QUICK = ((2, 2, 16, 8), (1, 2, 64, 16))
PASSES = ("fwd", "fwd+bwd")


def cases(quick: bool) -> list[tuple[tuple, bool, str]]:
    """``(shape, causal, pass)`` of every row, in the order measured."""
    return [(s, c, p) for s in (QUICK if quick else FULL) for c in (False, True) for p in PASSES]


def flops(shape, causal: bool, pass_: str) -> float:
    b, h, t, d = shape
    return (fwd_bwd_flops if pass_ == "fwd+bwd" else forward_flops)(b, h, t, t, d, causal)


class _Free:
    """:mod:`qkv.kernels.rows.kernel.fused` with its row passes left out (``passes=False``)."""

    def __init__(self, real):
        self.real = real
        # one entry per softcap x dropout case (rows_fused.FORWARD/BACKWARD), each called with passes=False
        self.FORWARD = {case: _without_passes(kern) for case, kern in real.FORWARD.items()}
        self.BACKWARD = {case: _without_passes(kern) for case, kern in real.BACKWARD.items()}

    def __getattr__(self, name):      # SGEMM, ILP64, CONCURRENT: the real module's
        return getattr(self.real, name)


def _without_passes(kern):
    """``kern`` called with its last argument, ``passes``, False."""
    return lambda *args: kern(*args[:-1], False)


def products_only(fn):
    """``fn`` (a runner of ``method="auto"``) run with the row kernel's element-wise passes
    left out, or None without the fast extra (the NumPy row kernel has no such switch). The
    results are garbage; only the time counts."""
    from qkv.kernels.rows import kernel as rows
    if rows._fused() is None:
        return None
    from qkv import jit

    def run():
        real = jit._loaded[jit.ROWS_FUSED]
        jit._loaded[jit.ROWS_FUSED] = _Free(real)
        try:
            return fn()
        finally:
            jit._loaded[jit.ROWS_FUSED] = real
    return run


def measure(repeats: int, quick: bool, progress=None, *, seed: int = 0) -> list[dict]:
    """One row per shape, causal flag and pass: ``shape`` [B, H, T, D], ``causal``, ``pass``,
    ``qkv_s`` and ``torch_s`` (medians), ``ratio`` (median of torch ÷ qkv within a repeat),
    ``flop`` and ``qkv_gflops``/``torch_gflops``, ``products_s`` and ``bound`` (torch ÷ products
    within a repeat; None without the fast extra). The caller sets the threads of both sides."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for shape, causal, pass_ in cases(quick):
        if progress:
            progress(f"{shape} {'causal' if causal else 'full'} {pass_}")
        b, h, t, d = shape
        q, k, v, dout = inputs(rng, b, h, h, t, t, d)
        backward = pass_ == "fwd+bwd"
        fns = {"qkv": runner("auto", q, k, v, dout, causal=causal, backward=backward),
               "torch": runner("torch", q, k, v, dout, causal=causal, backward=backward)}
        free = products_only(fns["qkv"])
        if free is not None:
            fns["products"] = free
        runs = rounds(fns, repeats, rotate=True)
        walls = {m: [w for w, _ in r] for m, r in runs.items()}
        secs = {m: statistics.median(w) for m, w in walls.items()}
        per = lambda m: statistics.median(a / b_ for a, b_ in zip(walls["torch"], walls[m]))  # noqa: E731
        f = flops(shape, causal, pass_)
        rows.append(dict(shape=list(shape), causal=causal, **{"pass": pass_}, qkv_s=secs["qkv"],
                         torch_s=secs["torch"], ratio=per("qkv"),
                         flop=f, qkv_gflops=f / secs["qkv"] / 1e9, torch_gflops=f / secs["torch"] / 1e9,
                         products_s=secs.get("products"), bound=per("products") if free else None))
    return rows
