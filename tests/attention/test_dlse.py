"""attention_backward(dlse=): the gradient of a loss that uses the returned lse too,
``dS = P ∘ (dP - delta + dlse)``, against finite differences and between the kernels."""
import numpy as np
import pytest

import qkv


def _loss(q, k, v, dout, dlse, opts):
    out, lse = qkv.attention(q, k, v, return_lse=True, method="reference", **opts)
    return float(np.sum(out * dout) + np.sum(np.where(np.isfinite(lse), lse, 0) * dlse))


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window=(2, 1), kv_lengths=np.array([5, 7])),
                                  dict(causal=True, q_lengths=np.array([4, 6]), gqa=True)])
def test_dlse_matches_finite_differences_and_both_kernels_agree(opts):
    rng = np.random.default_rng(0)
    hk = 1 if opts.get("gqa") else 2
    q = rng.standard_normal((2, 2, 6, 4))
    k, v = rng.standard_normal((2, hk, 7, 4)), rng.standard_normal((2, hk, 7, 3))
    dout, dlse = rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6))
    out, lse = qkv.attention(q, k, v, return_lse=True, **opts)
    grads = {m: qkv.attention_backward(dout, q, k, v, out, lse, dlse=dlse, method=m, **opts)
             for m in ("reference", "flash")}
    for a, b in zip(grads["reference"], grads["flash"]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    eps = 1e-6
    for arr, g in zip((q, k, v), grads["reference"]):
        for idx in [tuple(rng.integers(0, s) for s in arr.shape) for _ in range(6)]:
            old = arr[idx]
            arr[idx] = old + eps
            up = _loss(q, k, v, dout, dlse, opts)
            arr[idx] = old - eps
            down = _loss(q, k, v, dout, dlse, opts)
            arr[idx] = old
            assert abs((up - down) / (2 * eps) - g[idx]) < 1e-6, (idx, g[idx])


def test_float32_dlse_within_the_error_budget():
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 2, 40, 8)) * s for s in (2.0, 2.0, 1.0, 1.0))
    dlse = rng.standard_normal((1, 2, 40))
    o, l = qkv.attention(q, k, v, causal=True, return_lse=True, method="reference")
    exact = qkv.attention_backward(dout, q, k, v, o, l, dlse=dlse, causal=True, method="reference")
    f = [x.astype(np.float32) for x in (q, k, v, dout, dlse)]
    errs = {}
    for m in ("reference", "flash"):
        o32, l32 = qkv.attention(*f[:3], causal=True, return_lse=True, method=m)
        got = qkv.attention_backward(f[3], *f[:3], o32, l32, dlse=f[4], causal=True, method=m)
        errs[m] = [float(np.abs(g - e).max()) for g, e in zip(got, exact)]
    floor = 4 * np.spacing(np.float32(max(np.abs(e).max() for e in exact)))
    for dense, tiled in zip(errs["reference"], errs["flash"]):
        assert tiled <= 2 * max(dense, floor)


def test_dlse_shape_is_checked():
    x = np.zeros((1, 2, 4, 3))
    out, lse = qkv.attention(x, x, x, return_lse=True)
    with pytest.raises(qkv.ShapeError, match=r"dlse must have shape \(\.\.\., Hq, Tq\) = \(1, 2, 4\); got \(1, 2, 3\)"):
        qkv.attention_backward(out, x, x, x, out, lse, dlse=np.zeros((1, 2, 3)))
