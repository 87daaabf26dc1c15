"""Run under ``mpiexec -n W python -m mpi4py tests/distributed/mpi_ring_cases.py``; driven by
test_distributed.py. Every rank builds the same whole arrays, runs the ring on its shard
and compares forward, lse and the three gradients with qkv.attention on the whole arrays.
Prints one line per rank: ``rank R ok N cases float32-ratio X``; any mismatch raises, which
under ``-m mpi4py`` ends the job with a non-zero status. Then every rank calls the ring with
a bad shape on the last rank only and prints the ShapeError it got."""
import os
import sys

import numpy as np
from mpi4py import MPI

import qkv
from qkv import distributed as dist

comm = MPI.COMM_WORLD
W, r = comm.Get_size(), comm.Get_rank()
T = 24   # divides into 2W chunks for W = 1..4
TOL = 1e-10

CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal+window": dict(causal=True, window=5),
    "causal+kv_lengths": dict(causal=True, kv_lengths=np.array([T, 13])),
    "window(3,4)+kv_lengths": dict(window=(3, 4), kv_lengths=np.array([9, T])),
    "alibi": dict(alibi=np.array([0.5, 0.25, 0.125, 1.0])),
    "causal+alibi": dict(causal=True, alibi=np.array([0.5, 0.25, 0.125, 1.0])),
    "chunk+causal": dict(causal=True, chunk=7),
    "bottom_right+kv_lengths": dict(causal=True, align="bottom_right", kv_lengths=np.array([20, 11])),
    "gqa+causal": dict(causal=True, gqa=True),
    "gqa+window+scale": dict(window=(4, 2), gqa=True, scale=0.3),
    # realistic magnitudes: scores of +-30 and more take the backward's precise rows, which
    # are normalised by their sums over every key, not over the block a rank holds
    "scale8": dict(scale=8.0),
    "causal+kv_lengths+scale8": dict(causal=True, kv_lengths=np.array([T, 13]), scale=8.0),
    "gqa+alibi+scale10": dict(gqa=True, alibi=np.array([0.5, 0.25, 0.125, 1.0]), scale=10.0),
}


def arrays(case, opts, dtype=np.float64):
    rng = np.random.default_rng(7)   # the same whole arrays on every rank
    hkv = 2 if opts.get("gqa") else 4
    q = rng.standard_normal((2, 4, T, 8))
    k = rng.standard_normal((2, hkv, T, 8))
    v = rng.standard_normal((2, hkv, T, 6))
    dout = rng.standard_normal((2, 4, T, 6))
    if "kv_lengths" in opts:  # padding keys hold NaN: they must never be read
        for b, n in enumerate(opts["kv_lengths"]):
            k[b, :, n:] = np.nan
            v[b, :, n:] = np.nan
    return [x.astype(dtype) for x in (q, k, v, dout)]


def say(line):
    """One line in one write, so the ranks' lines do not interleave."""
    os.write(1, (line + "\n").encode())


def check(name, got, want):
    same = got == want                     # -inf lse of a row that sees nothing
    with np.errstate(invalid="ignore"):
        err = np.max(np.abs(np.where(same, 0.0, got - want)), initial=0.0)
    if np.isnan(got).any() or not err <= TOL * max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))):
        raise AssertionError(f"rank {r}: {name} differs by {err}")


done = 0
ratio = 0.0
for layout in ("zigzag", "contiguous"):
    for case, opts in CASES.items():
        q, k, v, dout = arrays(case, opts)
        out, lse = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
        grads = qkv.attention_backward(dout, q, k, v, out, lse, method="reference", **opts)
        sh = [dist.shard(x, layout=layout) for x in (q, k, v, dout)]
        o, ls = dist.ring_attention(*sh[:3], layout=layout, return_lse=True, **opts)
        check(f"{layout} {case} out", o, dist.shard(out, layout=layout))
        check(f"{layout} {case} lse", ls, dist.shard(lse[..., None], layout=layout)[..., 0])
        g = dist.ring_attention_backward(sh[3], *sh[:3], o, ls, layout=layout, **opts)
        for gn, a, b in zip(("dq", "dk", "dv"), g, grads):
            check(f"{layout} {case} {gn}", a, dist.shard(b, layout=layout))
        check(f"{layout} {case} unshard", dist.unshard(o, layout=layout), out)
        done += 1

# float32: within 2x of the single-process float32 error against float64 (Frobenius norms
# over the whole arrays, as tests/attention/test_flash.py measures), forward and the three gradients
def norm_err(x, ref):
    return float(np.sum((np.asarray(x, np.float64) - ref) ** 2))


for layout in ("zigzag", "contiguous"):
    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((1, 2, 96, 32)) for _ in range(4))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True, method="reference")
    exact = [out] + list(qkv.attention_backward(dout, q, k, v, out, lse, causal=True, method="reference"))
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    o32, l32 = qkv.attention(*f32[:3], causal=True, return_lse=True, method="reference")
    single = [o32] + list(qkv.attention_backward(f32[3], *f32[:3], o32, l32, causal=True, method="reference"))
    sh = [dist.shard(x, layout=layout) for x in f32]
    o, ls = dist.ring_attention(*sh[:3], layout=layout, causal=True, return_lse=True)
    ring = [o] + list(dist.ring_attention_backward(sh[3], *sh[:3], o, ls, layout=layout, causal=True))
    for name, a, s1, e in zip(("out", "dq", "dk", "dv"), ring, single, exact):
        if a.dtype != np.float32:
            raise AssertionError(f"float32 ring {name} has dtype {a.dtype}")
        ring_err = comm.allreduce(norm_err(a, dist.shard(e, layout=layout)), op=MPI.SUM) ** 0.5
        single_err = norm_err(s1, e) ** 0.5
        ratio = max(ratio, ring_err / single_err)
        if ring_err > 2 * single_err:
            raise AssertionError(f"float32 ring {name} error {ring_err} > 2 x single-process {single_err}")

# the sequence-parallel layer equals the single-process one: output, dx, parameter grads
for layout in ("zigzag", "contiguous"):
    for kw, std in ((dict(causal=True, rope=True, n_kv_heads=2, bias=True), 1.0),
                    (dict(window=(3, 2), alibi=True), 1.0),
                    (dict(causal=True), 4.0)):   # inputs of std 4, as in a trained model
        rng = np.random.default_rng(3)
        x, dy = std * rng.standard_normal((2, T, 16)), rng.standard_normal((2, T, 16))
        whole = qkv.nn.MultiHeadAttention(16, 4, dtype=np.float64, rng=np.random.default_rng(5), **kw)
        ring = dist.RingMultiHeadAttention(16, 4, layout=layout, dtype=np.float64,
                                           rng=np.random.default_rng(5), **kw)
        y = whole.forward(x)
        dx = whole.backward(dy)
        check(f"layer {layout} {kw} y", ring.forward(dist.shard(x, layout=layout)), dist.shard(y, layout=layout))
        check(f"layer {layout} {kw} dx", ring.backward(dist.shard(dy, layout=layout)), dist.shard(dx, layout=layout))
        for name in whole.grads:
            check(f"layer {layout} {kw} d{name}", ring.grads[name], whole.grads[name])
        done += 1

# blocks the mask removes entirely are not computed: count the kernel calls
import qkv.distributed.ring as ring_module
from qkv.kernels import flash as real_flash

calls = []
real_forward = real_flash.forward


class Counting:
    backward = staticmethod(real_flash.backward)

    @staticmethod
    def forward(*args, **kwargs):
        calls.append(args[3])
        return real_forward(*args, **kwargs)


ring_module.flash = Counting
for layout, expect in (("zigzag", 2 * W + 1), ("contiguous", r + 1)):
    calls.clear()
    q, k, v, _ = arrays("count", {})
    dist.ring_attention(*(dist.shard(x, layout=layout) for x in (q, k, v)), layout=layout, causal=True)
    if len(calls) != expect:
        raise AssertionError(f"{layout} causal ran {len(calls)} kernel calls on rank {r}; expected {expect}")
ring_module.flash = real_flash

pos = dist.positions(T)
if not np.array_equal(dist.shard(np.arange(T)[:, None])[:, 0], pos):
    raise AssertionError("shard(arange) != positions")
say(f"rank {r} ok {done} cases float32-ratio {ratio:.3f}")

# a bad shape on the last rank only: every rank must raise the same ShapeError
rng = np.random.default_rng(0)
c = T // W
q = rng.standard_normal((1, 2, c, 8))
k = rng.standard_normal((1, 2, c, 8 if r < W - 1 else 5))
try:
    dist.ring_attention(q, k, k, causal=True)
except qkv.ShapeError as err:
    say(f"rank {r} raised: {err}")
else:
    say(f"rank {r} did not raise")
# ranks that disagree on an option: every rank raises, naming it
try:
    dist.ring_attention(q, q, q, causal=(r == 0) or W == 1, window=2 if W == 1 else None)
except qkv.ShapeError as err:
    say(f"rank {r} disagreed: {err}")
if len(sys.argv) > 1 and sys.argv[1] == "uncaught":
    dist.ring_attention(q, k, k, causal=True)  # now let it end the job
