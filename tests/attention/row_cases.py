"""What the row kernels' tests share (``test_rows.py``, the compiled one; ``test_rows_numpy.py``,
its NumPy form): inputs, the masks they run, and every result judged against the oracle."""
import numpy as np

import qkv
from qkv import api

import oracle
from differential import judge, one_hot_row, plain  # noqa: F401  (one_hot_row: the row tests' too)

MASKS = [dict(), dict(causal=True), dict(causal="bottom_right"), dict(window=(5, 3)), dict(window=(None, 0)),
         dict(causal=True, chunk=7), dict(chunk=16, align="bottom_right"), dict(causal=True, window=(0, 0))]


def inputs(shape_q, shape_kv, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    q = (scale * rng.standard_normal(shape_q)).astype(np.float32)
    k, v = ((scale * rng.standard_normal(shape_kv)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(shape_q[:-1] + (shape_kv[-1],)).astype(np.float32)
    return q, k, v, dout


def large_scores(std: float, seed: int = 0):
    """q, k of std ``sqrt(std)``: scores of std ``std`` (D = 16, the default scale); v and dout N(0, 1)."""
    rng = np.random.default_rng(seed)
    q, k = ((rng.standard_normal((2, 3, 37, 16)) * np.sqrt(std)).astype(np.float32) for _ in range(2))
    v, dout = (rng.standard_normal((2, 3, 37, 16)).astype(np.float32) for _ in range(2))
    return q, k, v, dout


def check(kernel, q, k, v, dout, dlse=None, **opts) -> list:
    """Every result of attention + attention_backward (method="auto", which must choose
    ``kernel``) against the oracle, within the float32 budget: the failures, if any."""
    assert api.choose_kernel("auto", api.prepare(q, k, v, **opts), False) is kernel
    want = oracle.solve(q, k, v, dout, dlse=dlse, **opts)
    base = plain(oracle.solve(q, k, v, dout, dlse=dlse, dtype=np.float32, **opts), np.float32)
    out, lse = qkv.attention(q, k, v, return_lse=True, **opts)
    grads = qkv.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **opts)
    fails = [judge("out", out, want.out, want.size["out"], base.out, np.float32),
             judge("lse", lse, want.lse, want.size["lse"], base.lse, np.float32)]
    for name, got in zip(("dq", "dk", "dv"), grads):
        fails.append(judge(name, got, getattr(want, name), want.size[name], getattr(base, name), np.float32))
    return [f for f in fails if f]


def differential_cases(kernel) -> tuple[int, list]:
    """The harness's random float32 problems (lengths, extreme values, every alignment) that
    ``auto`` gives ``kernel``, each checked: ``(how many, their failures)``."""
    from problems import cases

    taken, fails = 0, []
    for case in cases(7, 400, "core"):
        a, opts = case.arrays, case.opts
        if a["q"].dtype != np.float32:
            continue
        try:
            prob = api.prepare(a["q"], a["k"], a["v"], **opts)
        except qkv.ShapeError:
            continue
        if api.choose_kernel("auto", prob, False) is not kernel:
            continue
        taken += 1
        fails += [f"{case}: {f}" for f in check(kernel, a["q"], a["k"], a["v"], a["dout"], **opts)]
    return taken, fails


def hf_gqa_layout(seed: int) -> tuple:
    """q contiguous (after RoPE), k and v (B, Hkv, T, D) views of (B, T, Hkv, D) and dout a view
    of (B, T, Hq, D), as transformers hands a GQA layer's arrays over (B=3, T=70, 6 over 2 heads)."""
    rng = np.random.default_rng(seed)
    b, t, hq, hkv, d = 3, 70, 6, 2, 16
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, t, hkv, d)).astype(np.float32).transpose(0, 2, 1, 3) for _ in range(2))
    dout = rng.standard_normal((b, t, hq, d)).astype(np.float32).transpose(0, 2, 1, 3)
    return q, k, v, dout


def same_bits_as_copies(q, k, v, dout, threads: int = 2, **opts) -> None:
    """Forward and backward on the arrays as given and on contiguous copies: the same bits."""
    from qkv.threads import kernel_threads

    runs = []
    for arrays in ((q, k, v, dout), tuple(np.ascontiguousarray(a) for a in (q, k, v, dout))):
        qq, kk, vv, dd = arrays
        with kernel_threads(threads):
            out, lse = qkv.attention(qq, kk, vv, return_lse=True, **opts)
            runs.append((out, lse) + qkv.attention_backward(dd, qq, kk, vv, out, lse, **opts))
    for a, c in zip(*runs):
        np.testing.assert_array_equal(a, c)


def hf_gqa_layout_case(kernel, seed: int) -> None:
    """GQA with k and v as (B, Hkv, T, D) views of (B, T, Hkv, D), as transformers hands them:
    each range of heads gathered from the views (no (B·Hkv, T, D) view of them exists); the
    same bits as contiguous copies, and within the budget."""
    from qkv.kernels.rows import kernel as rows

    q, k, v, dout = hf_gqa_layout(seed)
    assert rows._view(v, (-1,) + v.shape[-2:]) is None
    same_bits_as_copies(q, k, v, dout, causal=True, gqa=True)
    assert check(kernel, q, k, v, dout, causal=True, gqa=True) == []
