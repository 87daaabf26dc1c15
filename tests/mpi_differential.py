"""Run under ``mpiexec -n W python -m mpi4py tests/mpi_differential.py SEED N_RING N_LAYER``;
driven by tests/attention/test_differential.py.

Every rank draws the same problems (tests/problems.py, kinds ``"ring"`` and
``"ring_layer"``), runs ring attention (forward, lse, backward) or RingMultiHeadAttention
on its shard, and gathers the results (``unshard``); rank 0 judges them against the oracle
on the whole arrays (tests/oracle.py) and prints ``FAIL <case>`` with the reasons for each
failing case, then one line ``differential W=...: N cases ...``. Exceptions are caught per
case (every rank raises alike: the checks are collective), so one bad case does not end
the job. ``QKV_DIFFERENTIAL_CASES=ring:13,ring_layer:1`` runs only those cases (a reproduction).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import qkv  # noqa: E402
from qkv import distributed as dist  # noqa: E402

import differential as df  # noqa: E402
import oracle  # noqa: E402

comm = MPI.COMM_WORLD
W, r = comm.Get_size(), comm.Get_rank()


def say(text):
    os.write(1, (text + "\n").encode())


def guarded(case, what, fn, fails):
    """``(fn(), ok)``; exceptions other than an allowed ShapeError and RuntimeWarnings fail."""
    return df.attempt(case, what, fn, fails, where=f" (rank {r})")


def check_ring(case):
    a, opts, layout = case.arrays, case.opts, case.extra["layout"]
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    sh = [dist.shard(x, layout=layout) for x in (q, k, v, dout)]
    fails = []
    fwd, ok = guarded(case, "ring_attention", lambda: dist.ring_attention(*sh[:3], layout=layout, return_lse=True,
                                                                          **opts), fails)
    if not ok:
        return fails
    o, ls = fwd
    grads, ok = guarded(case, "ring_attention_backward",
                        lambda: dist.ring_attention_backward(sh[3], *sh[:3], o, ls, layout=layout, **opts), fails)
    whole = [dist.unshard(o, layout=layout), dist.unshard(ls[..., None], layout=layout)[..., 0]]
    if ok:
        whole += [dist.unshard(g, layout=layout) for g in grads]
    if r != 0:
        return fails
    want = oracle.solve(q, k, v, dout, **opts)
    base = None if q.dtype == np.float64 else oracle.solve(q, k, v, dout, dtype=np.float32, **opts)
    lse_dt = np.float64 if q.dtype == np.float64 else np.float32
    for name, got, dt in zip(("out", "lse", "dq", "dk", "dv"), whole, (q.dtype, lse_dt) + (q.dtype,) * 3):
        fails.append(df.judge(f"ring {name}", got, getattr(want, name), want.size[name],
                              None if base is None else getattr(base, name), dt))
    return [f for f in fails if f]


def check_ring_layer(case):
    layout, a = case.extra["layout"], case.arrays
    fails = []
    layer, ok = guarded(case, "RingMultiHeadAttention(...)", lambda: df.build_mha(case, dist.RingMultiHeadAttention),
                        fails)
    if not ok:
        return fails

    def run():
        y = layer.forward(dist.shard(a["x"], layout=layout), **case.opts)
        dx = layer.backward(dist.shard(a["dy"], layout=layout))
        return dict(y=dist.unshard(y, layout=layout), dx=dist.unshard(dx, layout=layout),
                    **{f"d{n}": np.array(g) for n, g in layer.grads.items()})

    got, ok = guarded(case, "RingMultiHeadAttention forward/backward", run, fails)
    if ok and r == 0:
        fails += df.judge_mha(case, got, {n: np.array(p) for n, p in layer.params.items()})
    return fails


def main():
    failing = 0
    seed, n_ring, n_layer = (int(x) for x in sys.argv[1:4])
    only = [tuple(item.split(":")) for item in os.environ.get("QKV_DIFFERENTIAL_CASES", "").split(",") if item]
    for kind, n, check in (("ring", n_ring, check_ring), ("ring_layer", n_layer, check_ring_layer)):
        picked = [int(i) for k, i in only if k == kind] if only else range(n)
        for index in picked:
            case = df.make_case(seed, index, kind, world=W)
            fails = check(case)
            if fails and r == 0:
                failing += 1
                say(f"FAIL {case}\n      " + "\n      ".join(fails))
    if r == 0:
        say(f"differential W={W}: {n_ring} ring cases and {n_layer} ring layer cases, {failing} failing")


if __name__ == "__main__":  # not on import (pytest's doctest collection imports every module)
    main()
