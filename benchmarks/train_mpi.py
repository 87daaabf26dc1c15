"""``qkv bench --suite train-mpi``: qkv's GPT trained by W ranks against one process with W threads.

Run under MPI, one process per rank (``mpiexec -n W qkv bench --suite train-mpi`` for
W = 1, 2, 4); this file runs alone too, for other sizes::

    mpiexec -n 2 python -m mpi4py -m qkv_benchmarks.train_mpi --block-size 1024 --batch-size 4
    mpiexec -n 2 python -m mpi4py -m qkv_benchmarks.train_mpi --mode context --block-size 16384 \\
        --batch-size 1 --repeats 1          # peak memory per rank of a long block

:func:`measure` is collective: every rank calls it and rank 0 gets the figures. One row per
mode (``data``, ``context``: :mod:`qkv.distributed.train`), on a GPT of :data:`FULL`'s shape,
float32, one thread a rank (qkv's and the BLAS's), a fixed random batch, AdamW:

- ``step_s``: wall time of one step (loss, backward with the gradients' Allreduce, AdamW),
  the slowest rank's, median over ``repeats`` after a warm-up; ``tokens_per_s = B·T / step_s``;
- ``backward_s``: the local backward alone (what an overlapped Allreduce would hide behind),
  ``allreduce_s``: the gradients' Allreduce, ``loss_allreduce_s``: the loss's (it waits for
  the slowest forward), medians of the per-step maximum over ranks;
- ``ring_s`` (context): time inside the ring attention calls less their kernels' time
  (sends, receives, waits and the ranks' collective checks), the slowest rank's per step;
- ``sent_bytes`` per rank and step::

      gradients  2 (W-1)/W · 4P          a ring Allreduce of the P-parameter buffer
      ring       n_layer · [2 (W-1) (|K|+|V|) + W (|dK|+|dV|)],   |K| = B·Hkv·(T/W)·D·4

- ``peak_mib`` per rank: resident-set high-water mark during the timed steps less the
  resident set before them (``memory.mark``): parameters and AdamW's moments are made before;
- ``single_*``: rank 0 alone trains the same model on the same batch with W threads, while
  the other ranks wait without spinning.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .memory import extra_bytes, mark
from .ring import _KernelClock, idle_wait

FULL = dict(vocab=65, n_layer=4, n_head=4, n_embd=128, batch=12, block=256)
QUICK = dict(vocab=65, n_layer=1, n_head=2, n_embd=32, batch=12, block=48)
MODES = ("data", "context")


def _mpi():
    from mpi4py import MPI

    return MPI


def _threads(n: int):
    """qkv's kernel threads and the BLAS pool held to ``n``; returns the limiter (keep it)."""
    from threadpoolctl import threadpool_limits

    import qkv

    qkv.set_num_threads(n)
    return threadpool_limits(limits=n, user_api="blas")


def _config(size: dict, block: int):
    from qkv.models import GPTConfig

    return GPTConfig(vocab_size=size["vocab"], block_size=block, n_layer=size["n_layer"], n_head=size["n_head"],
                     n_embd=size["n_embd"], bias=False, dtype=np.float32, seed=0)


def _batch(size: dict, block: int):
    rng = np.random.default_rng(0)   # the same batch on every rank
    x = rng.integers(0, size["vocab"], (size["batch"], block + 1))
    return x[:, :-1], x[:, 1:]


class _RingClock:
    """Times the ring attention calls of the ring layers, and (``_KernelClock``) their kernels."""

    def __init__(self):
        from qkv.distributed import layer

        self.layer, self.seconds = layer, 0.0
        self.saved = (layer.ring_attention, layer.ring_attention_backward)
        self.kernels = _KernelClock()

    def _timing(self, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return call

    def __enter__(self):
        self.layer.ring_attention, self.layer.ring_attention_backward = map(self._timing, self.saved)
        self.kernels.__enter__()
        return self

    def __exit__(self, *exc):
        self.kernels.__exit__(*exc)
        self.layer.ring_attention, self.layer.ring_attention_backward = self.saved

    @property
    def waiting(self) -> float:
        return self.seconds - self.kernels.seconds


def block_for(size: dict, w: int) -> int:
    """The largest block <= ``size["block"]`` that 2W zigzag chunks divide."""
    return size["block"] - size["block"] % (2 * w)


def measure(comm, mode: str, size: dict, repeats: int, *, single: bool = True) -> dict | None:
    """The figures above for one mode; every rank calls it, rank 0 gets them (others None)."""
    w, r = comm.Get_size(), comm.Get_rank()
    block = block_for(size, w)
    with _threads(1):
        seen, peaks, par = _steps(comm, mode, size, block, repeats)
    res = None
    if r == 0:
        med = {k: statistics.median(v) for k, v in seen.items()}
        c = par.config
        kv = size["batch"] * (c.n_kv_head or c.n_head) * (block // w) * (c.n_embd // c.n_head) * 4   # |K| bytes
        ring = c.n_layer * (2 * (w - 1) * 2 * kv + w * 2 * kv) if mode == "context" and w > 1 else 0
        res = dict(mode=mode, W=w, B=size["batch"], T=block, params=int(sum(p.size for p in par.params.values())),
                   step_s=med["step"], tokens_per_s=size["batch"] * block / med["step"], backward_s=med["backward"],
                   allreduce_s=med["grads"], loss_allreduce_s=med["loss"],
                   ring_s=med["ring"] if mode == "context" else None, grad_bytes=par.grad_bytes,
                   sent_bytes=2 * (w - 1) / w * par.grad_bytes + ring, peak_mib=peaks)
    if single:
        if r == 0:
            res.update(_single(size, block, w, repeats))
            res["vs_single"] = res["tokens_per_s"] / res["single_tokens_per_s"]
        idle_wait(comm)
    return res


def _steps(comm, mode: str, size: dict, block: int, repeats: int):
    """Every rank: the per-step maxima over ranks of each timed part, the peaks (rank 0), the model."""
    from qkv.distributed.train import ParallelGPT
    from qkv.models import GPT
    from qkv.nn import AdamW

    MPI = _mpi()
    x, y = _batch(size, block)
    par = ParallelGPT(GPT(_config(size, block)), mode, comm=comm)
    opt = AdamW(par.model, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, clip=1.0)
    seen = {k: [] for k in ("step", "backward", "grads", "loss", "ring")}
    idle_wait(comm)
    since = mark()
    for i in range(repeats + 1):   # i = 0 is the warm-up
        before = dict(par.comm_seconds)
        comm.Barrier()
        with _RingClock() as clock:
            t0 = time.perf_counter()
            par.loss(x, y)
            t1 = time.perf_counter()
            par.backward()
            t2 = time.perf_counter()
            opt.step(1e-4)
            t3 = time.perf_counter()
        grads = par.comm_seconds["grads"] - before["grads"]
        mine = dict(step=t3 - t0, backward=t2 - t1 - grads, grads=grads,
                    loss=par.comm_seconds["loss"] - before["loss"], ring=clock.waiting)
        if i:
            for k, v in mine.items():
                seen[k].append(comm.allreduce(v, op=MPI.MAX))
    return seen, comm.gather(extra_bytes(since) / 2 ** 20, root=0), par


def _single(size: dict, block: int, threads: int, repeats: int) -> dict:
    """One process, ``threads`` threads, the same model and batch."""
    from qkv.models import GPT
    from qkv.nn import AdamW

    x, y = _batch(size, block)
    model = GPT(_config(size, block))
    opt = AdamW(model, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, clip=1.0)
    times = []
    since = mark()
    with _threads(threads):
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.loss(x, y)
            model.backward()
            opt.step(1e-4)
            if i:
                times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return dict(single_threads=threads, single_step_s=step, single_tokens_per_s=size["batch"] * block / step,
                single_peak_mib=extra_bytes(since) / 2 ** 20)


def suite(comm, size: dict, repeats: int, progress=None) -> list | None:
    """``qkv bench --suite train-mpi``: :func:`measure` for each mode (the single process
    once, with the first); rank 0 gets the rows. ``progress(advance, description=None)``."""
    progress = progress or (lambda advance, description=None: None)
    rows = []
    for i, mode in enumerate(MODES):
        progress(0, description=f"train-mpi: {mode} parallel, {comm.Get_size()} ranks")
        row = measure(comm, mode, size, repeats, single=i == 0)
        if row is not None and rows:
            row.update({k: v for k, v in rows[0].items() if k.startswith("single_")})
            row["vs_single"] = row["tokens_per_s"] / row["single_tokens_per_s"]
        rows.append(row)
        progress(1)
    return rows if comm.Get_rank() == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES + ("both",), default="both")
    for name in ("batch", "block", "n_layer", "n_head", "n_embd"):
        p.add_argument(f"--{name.replace('_', '-')}{'-size' if name in ('batch', 'block') else ''}", dest=name,
                       type=int, default=FULL[name])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single", default="yes", choices=("yes", "none"), help="also time one process")
    a = p.parse_args(argv)
    size = dict(FULL, **{k: getattr(a, k) for k in ("batch", "block", "n_layer", "n_head", "n_embd")})
    comm = _mpi().COMM_WORLD
    for mode in MODES if a.mode == "both" else (a.mode,):
        res = measure(comm, mode, size, a.repeats, single=a.single == "yes")
        if res is not None:
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
