"""``qkv bench --suite ring``: ring attention over MPI against the same problem on one process.

Run under MPI, one process per rank: ``mpiexec -n W qkv bench --suite ring`` runs
:func:`suite` (both layouts at T = 16384 and the ping-pong bandwidth); this file runs alone
too, for other sizes::

    mpiexec -n 2 python -m mpi4py -m qkv_benchmarks.ring --T 16384
    mpiexec -n 4 python -m mpi4py -m qkv_benchmarks.ring --T 131072 --single none   # headline

:func:`measure` is collective: every rank calls it and rank 0 gets the figures. For one
problem (B = 1, H heads, D, float32, causal unless ``causal=False``) it reports:

- ``ring_fwd_s``, ``ring_fwdbwd_s``: wall time of ``ring_attention`` (and then
  ``ring_attention_backward``), the slowest rank's, median over repeats, one kernel thread
  a rank (``threads``);
- ``compute_s`` per rank: the time inside the kernel calls of one forward+backward (the
  block work without the waits), and ``balance = max / min`` of it;
- ``sent_bytes`` per rank: what the ring posts with ``Isend`` (the same on every rank)::

      forward   (W - 1) · (|K| + |V|)
      backward  (W - 1) · (|K| + |V|) + W · (|dK| + |dV|)

- ``peak_mib`` per rank: the resident-set high-water mark during the timed calls minus the
  resident set before them (``memory.mark``);
- ``single_*``: the same problem on rank 0 alone with ``qkv.attention(method="flash")`` and
  W kernel threads, while the other ranks wait without spinning (``Ibarrier`` + sleep);
- ``ratio = ring / single`` for forward+backward.

FLOP (forward, causal) ``2 · B · H · T² · D``; forward+backward 3.5× that.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .memory import extra_bytes, mark


def _mpi():
    from mpi4py import MPI

    return MPI


class _KernelClock:
    """Times the kernel calls ring attention makes (wraps ``qkv.distributed.ring.flash``)."""

    def __init__(self):
        from qkv.distributed import ring
        from qkv.kernels import flash

        self.ring, self.flash, self.seconds = ring, flash, 0.0
        # a stand-in for the flash module with its kernel entry points timed, the rest as they are
        members = {name: getattr(flash, name) for name in flash.__all__}
        members.update({name: self._timing(getattr(flash, name)) for name in ("forward", "backward", "row_sums")})
        self.timed = type("Timed", (), {name: staticmethod(fn) if callable(fn) and not isinstance(fn, type) else fn
                                        for name, fn in members.items()})

    def _timing(self, fn):
        """``fn`` that adds the seconds each call takes to ``self.seconds``."""
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return call

    def __enter__(self):
        self.ring.flash = self.timed
        return self

    def __exit__(self, *exc):
        self.ring.flash = self.flash


def idle_wait(comm) -> None:
    """Wait for the other ranks without spinning a core (MPICH's Barrier busy-polls): a
    collective, every rank calls it."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def measure(comm=None, *, T=16384, H=1, D=64, causal=True, layout="zigzag", repeats=3,
            threads=1, single=True, backward=True, warmup=True, clock=True) -> dict | None:
    """The figures above for one problem; every rank calls it, rank 0 gets them (others None)."""
    import qkv
    from qkv import distributed as dist

    MPI = _mpi()
    comm = comm or MPI.COMM_WORLD
    W, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(0)
    c = T // W
    q, k, v, dout = (rng.standard_normal((1, H, c, D), dtype=np.float32) for _ in range(4))
    opts = dict(comm=comm, layout=layout, causal=causal)
    qkv.threads.set_num_threads(threads)
    fwd, both = [], []
    idle_wait(comm)
    since = mark()
    for i in range(int(not warmup), repeats + 1):  # i = 0 is a warm-up
        comm.Barrier()
        t0 = time.perf_counter()
        out, lse = dist.ring_attention(q, k, v, return_lse=True, **opts)
        t1 = time.perf_counter()
        if backward:
            dist.ring_attention_backward(dout, q, k, v, out, lse, **opts)
        t2 = time.perf_counter()
        if i:
            fwd.append(comm.allreduce(t1 - t0, op=MPI.MAX))
            both.append(comm.allreduce(t2 - t0, op=MPI.MAX))
    peak = extra_bytes(since) / 2 ** 20
    with _KernelClock() as timer:
        if clock:
            out, lse = dist.ring_attention(q, k, v, return_lse=True, **opts)
            if backward:
                dist.ring_attention_backward(dout, q, k, v, out, lse, **opts)
    compute = comm.gather(timer.seconds, root=0)
    peaks = comm.gather(peak, root=0)
    kv = q.nbytes * 2                    # |K| + |V| (Hkv = H, Dv = D, float32)
    sent = (W - 1) * kv + ((W - 1) * kv + W * kv if backward else 0)
    res = None
    if r == 0:
        flop = 4 * H * T * T * D / (2 if causal else 1)
        res = dict(W=W, T=T, H=H, D=D, causal=causal, layout=layout, threads=threads,
                   ring_fwd_s=statistics.median(fwd), ring_fwdbwd_s=statistics.median(both) if backward else None,
                   compute_s=compute if clock else None,
                   balance=max(compute) / min(compute) if clock else None, sent_bytes=sent,
                   peak_mib=peaks, fwd_gflops=flop / statistics.median(fwd) / 1e9)
    if single:
        if r == 0:
            res.update(_single(T, H, D, causal, W, repeats, backward))
            res["ratio"] = res["ring_fwdbwd_s" if backward else "ring_fwd_s"] / res["single_fwdbwd_s" if backward else "single_fwd_s"]
        idle_wait(comm)
    return res


def _single(T, H, D, causal, threads, repeats, backward) -> dict:
    import qkv

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, H, T, D), dtype=np.float32) for _ in range(4))
    qkv.threads.set_num_threads(threads)
    fwd, both = [], []
    since = mark()
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True, method="flash")
        t1 = time.perf_counter()
        if backward:
            qkv.attention_backward(dout, q, k, v, out, lse, causal=causal, method="flash")
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            both.append(t2 - t0)
    return dict(single_threads=threads, single_fwd_s=statistics.median(fwd),
                single_fwdbwd_s=statistics.median(both) if backward else None,
                single_peak_mib=extra_bytes(since) / 2 ** 20)


def suite(comm, size: dict, repeats: int, layouts, progress=None) -> tuple[list | None, float | None]:
    """``qkv bench --suite ring``: :func:`measure` for each ``(layout, single)`` of ``layouts``
    at the largest T <= ``size["t"]`` that 2W chunks divide (both layouts can split it),
    then :func:`bandwidth` of ``size["pingpong_bytes"]``. Collective; rank 0 gets
    ``(rows, GB/s)``, the others ``(None, None)``. One process (W = 1) leaves out every
    layout after the first: with one rank they all hold the sequence in order.
    ``progress(advance, description=None)`` as in ``suites.run_suites``."""
    progress = progress or (lambda advance, description=None: None)
    w = comm.Get_size()
    t = size["t"] - size["t"] % (2 * w)
    rows = []
    for i, (layout, single) in enumerate(layouts):
        if w > 1 or i == 0:
            progress(0, description=f"ring: {layout}, {w} ranks, T={t}")
            rows.append(measure(comm, T=t, H=size["h"], D=size["d"], layout=layout, repeats=repeats,
                                single=single))
        progress(1)
    progress(0, description="ring: ping-pong")
    gbs = bandwidth(comm, size["pingpong_bytes"], repeats)
    progress(1)
    return (rows, gbs) if comm.Get_rank() == 0 else (None, None)


def bandwidth(comm=None, nbytes=64 << 20, repeats=5) -> float | None:
    """Ranks 0 and 1 ping-pong ``nbytes``; rank 0 gets one direction's GB/s (median)."""
    MPI = _mpi()
    comm = comm or MPI.COMM_WORLD
    if comm.Get_size() < 2:
        return None
    buf = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        t = time.perf_counter()
        if comm.Get_rank() == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif comm.Get_rank() == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9 if comm.Get_rank() == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--H", type=int, default=1)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--not-causal", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="kernel threads per rank")
    p.add_argument("--single", default="yes", choices=("yes", "none"), help="also time one process")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="time the first call too (long runs)")
    p.add_argument("--no-clock", action="store_true", help="skip the extra run that times the kernels per rank")
    p.add_argument("--bandwidth", action="store_true", help="also ping-pong 64 MiB between ranks 0 and 1")
    a = p.parse_args(argv)
    res = measure(T=a.T, H=a.H, D=a.D, causal=not a.not_causal, layout=a.layout, repeats=a.repeats,
                  threads=a.threads, single=a.single == "yes", backward=not a.forward_only,
                  warmup=not a.no_warmup, clock=not a.no_clock)
    bw = bandwidth() if a.bandwidth else None
    if res is not None:
        if bw is not None:
            res["pingpong_gb_s"] = bw
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
