"""qkv.attention and qkv.attention_backward (reference path) against PyTorch SDPA,
torch autograd and finite differences, over every option of the contract."""
import warnings
import zlib

import numpy as np
import pytest
from helpers import oracle_allowed, oracle_bias, random_case

import qkv

torch = pytest.importorskip("torch", reason="PyTorch is the reference here: pip install -e '.[test]'")
F = torch.nn.functional

OPTION_KINDS = ["none", "mask", "bias", "causal", "bottom_right", "window", "window_causal",
                "kv_lengths", "alibi", "everything"]


def make_options(kind, rng, lead, tq, tk):
    """Options for qkv.attention of one kind, with shapes matching lead = (B, Hq)."""
    b, hq = lead
    if kind == "none":
        return {}
    if kind == "mask":
        return {"mask": rng.random((b, 1, tq, tk)) < 0.7}
    if kind == "bias":
        return {"bias": rng.standard_normal((hq, tq, tk))}
    if kind == "causal":
        return {"causal": True}
    if kind == "bottom_right":
        return {"causal": "bottom_right"}
    if kind == "window":
        return {"window": (2, 1)}
    if kind == "window_causal":
        return {"window": 3, "causal": "bottom_right"}
    if kind == "kv_lengths":
        return {"kv_lengths": rng.integers(1, tk + 1, size=b)}
    if kind == "alibi":
        return {"alibi": 2.0 ** -np.arange(1, hq + 1)}
    if kind == "everything":
        return {"mask": rng.random((tq, tk)) < 0.8, "bias": rng.standard_normal((b, hq, 1, tk)),
                "causal": "bottom_right", "window": (4, None), "kv_lengths": rng.integers(0, tk + 1, size=b),
                "alibi": rng.random(hq), "scale": 0.3}
    raise AssertionError(kind)


def torch_attention(q, k, v, opts, gqa, dtype=torch.float64, dout=None):
    """PyTorch SDPA with qkv's options spelled as one float mask. Returns out, alive, grads."""
    lead, tq, tk = q.shape[:-2], q.shape[-2], k.shape[-2]
    structure = {n: opts.get(n) for n in ("align", "kv_lengths", "q_lengths")}
    ok = oracle_allowed(lead, tq, tk, causal=opts.get("causal", False), window=opts.get("window"),
                        chunk=opts.get("chunk"), mask=opts.get("mask"), **structure)
    alive = ok.any(-1)
    # Rows that may attend to nothing are qkv's "out 0, grad 0"; PyTorch may give NaN there,
    # so let it see every key on those rows and feed them zero dout (their grads are then 0).
    ok = ok | ~alive[..., None]
    add = oracle_bias(lead, tq, tk, causal=opts.get("causal", False), bias=opts.get("bias"),
                      alibi=opts.get("alibi"), **structure)
    float_mask = torch.tensor(np.where(ok, add, -np.inf), dtype=dtype)
    tq_, tk_, tv_ = (torch.tensor(x.astype(np.float64), dtype=dtype, requires_grad=True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(tq_, tk_, tv_, attn_mask=float_mask, scale=opts.get("scale"),
                                         enable_gqa=gqa)
    grads = None
    if dout is not None:
        g = torch.tensor(np.where(alive[..., None], dout, 0.0), dtype=dtype)
        grads = [x.detach().numpy() for x in torch.autograd.grad(out, (tq_, tk_, tv_), g)]
    return out.detach().numpy(), alive, grads


@pytest.mark.parametrize("kind", OPTION_KINDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("sizes", [(1, 1, 8), (5, 9, 8), (97, 97, 59), (9, 5, 16)],
                         ids=["T1", "Tq<Tk", "T97-D59", "Tq>Tk"])
def test_forward_and_backward_match_pytorch_float64(kind, heads, sizes):
    rng = np.random.default_rng(zlib.crc32(repr((kind, heads, sizes)).encode()))
    (hq, hkv), (tq, tk, d) = heads, sizes
    q, k, v = random_case(rng, b=2, hq=hq, hkv=hkv, tq=tq, tk=tk, d=d, dv=d + 3)
    opts = make_options(kind, rng, (2, hq), tq, tk)
    gqa = hkv != hq
    out, lse = qkv.attention(q, k, v, gqa=gqa, return_lse=True, method="reference", **opts)
    dout = rng.standard_normal(out.shape)
    ref, alive, (rdq, rdk, rdv) = torch_attention(q, k, v, opts, gqa, dout=dout)
    np.testing.assert_allclose(out[alive], ref[alive], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(out[~alive], 0.0)
    assert (lse[~alive] == -np.inf).all() and np.isfinite(lse[alive]).all()

    dq, dk, dv = qkv.attention_backward(np.where(alive[..., None], dout, 0.0), q, k, v, out, lse,
                                        gqa=gqa, method="reference", **opts)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for ours, theirs in ((dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-11)


def test_bottom_right_equals_pytorch_causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(1)
    q, k, v = random_case(rng, b=1, hq=2, hkv=2, tq=3, tk=8, d=16)
    ours = qkv.attention(q, k, v, causal="bottom_right")
    tq_, tk_, tv_ = (torch.tensor(x) for x in (q, k, v))
    theirs = F.scaled_dot_product_attention(tq_, tk_, tv_, attn_mask=causal_lower_right(3, 8))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-12)
    # and causal=True is PyTorch's is_causal (top-left)
    theirs_tl = F.scaled_dot_product_attention(tq_[..., :8, :], tk_, tv_, is_causal=True)
    np.testing.assert_allclose(qkv.attention(q[..., :8, :], k, v, causal=True), theirs_tl.numpy(), rtol=1e-12)


def test_bool_mask_polarity_is_pytorchs():
    rng = np.random.default_rng(2)
    q, k, v = random_case(rng, b=1, hq=1, hkv=1, tq=4, tk=6, d=8)
    mask = rng.random((4, 6)) < 0.6
    mask[:, 0] = True
    theirs = F.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)), attn_mask=torch.tensor(mask))
    np.testing.assert_allclose(qkv.attention(q, k, v, mask=mask), theirs.numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float16, 2e-3)])
@pytest.mark.parametrize("kind", ["none", "causal", "everything"])
def test_low_precision_matches_pytorch(dtype, tol, kind):
    rng = np.random.default_rng(3)
    q, k, v = random_case(rng, dtype=dtype, b=2, hq=4, hkv=2, tq=97, tk=33, d=59)
    opts = make_options(kind, rng, (2, 4), 97, 33)
    out, lse = qkv.attention(q, k, v, gqa=True, return_lse=True, **opts)
    assert out.dtype == dtype and lse.dtype == np.float32
    ref, alive, _ = torch_attention(q, k, v, opts, gqa=True, dtype=torch.float32)
    np.testing.assert_allclose(out[alive].astype(np.float32), ref[alive], atol=tol, rtol=tol)
    dq, dk, dv = qkv.attention_backward(np.ones_like(out), q, k, v, out, lse, gqa=True, **opts)
    assert dq.dtype == dk.dtype == dv.dtype == dtype


def test_float32_error_is_that_of_plain_float32_math():
    rng = np.random.default_rng(4)
    q, k, v = random_case(rng, b=1, hq=2, hkv=2, tq=97, tk=97, d=64)
    exact = qkv.attention(q, k, v)
    ours = qkv.attention(*(x.astype(np.float32) for x in (q, k, v)))
    s = (q.astype(np.float32) @ np.swapaxes(k.astype(np.float32), -1, -2)) / np.float32(8.0)
    p = np.exp(s - s.max(-1, keepdims=True))
    plain = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float32)
    assert np.abs(ours - exact).max() <= 2 * np.abs(plain - exact).max() + 1e-7


@pytest.mark.parametrize("lead_q,lead_k", [((), ()), ((3,), (3,)), ((2, 3), (1, 3)), ((2, 1, 2), (4, 1)),
                                           ((1,), (5,))])
def test_leading_axes_broadcast_and_gradients_sum_back(lead_q, lead_k):
    rng = np.random.default_rng(5)
    q = rng.standard_normal(lead_q + (4, 6))
    k = rng.standard_normal(lead_k + (5, 6))
    v = rng.standard_normal(lead_k + (5, 2))
    out, lse = qkv.attention(q, k, v, return_lse=True)
    lead = np.broadcast_shapes(lead_q, lead_k)
    assert out.shape == lead + (4, 2)
    qb, kb, vb = (torch.tensor(np.broadcast_to(x, lead + x.shape[-2:]).copy(), requires_grad=True) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qb, kb, vb)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = qkv.attention_backward(dout, q, k, v, out, lse)
    gq, gk, gv = torch.autograd.grad(ref, (qb, kb, vb), torch.tensor(dout))

    def sum_to(g, shape):
        g = g.numpy()
        while g.ndim > len(shape):
            g = g.sum(0)
        return g.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)

    for ours, theirs, x in ((dq, gq, q), (dk, gk, k), (dv, gv, v)):
        assert ours.shape == x.shape
        np.testing.assert_allclose(ours, sum_to(theirs, x.shape), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", OPTION_KINDS)
def test_backward_matches_finite_differences(kind):
    rng = np.random.default_rng(6)
    q, k, v = random_case(rng, b=2, hq=2, hkv=1, tq=4, tk=6, d=5, dv=3)
    opts = make_options(kind, rng, (2, 2), 4, 6)
    g = rng.standard_normal((2, 2, 4, 3))

    def loss(q, k, v):
        return float(np.sum(qkv.attention(q, k, v, gqa=True, **opts) * g))

    out, lse = qkv.attention(q, k, v, gqa=True, return_lse=True, **opts)
    grads = qkv.attention_backward(g, q, k, v, out, lse, gqa=True, **opts)
    eps = 1e-6
    for idx, x in enumerate((q, k, v)):
        direction = rng.standard_normal(x.shape)
        args_p = [q, k, v]
        args_m = [q, k, v]
        args_p[idx] = x + eps * direction
        args_m[idx] = x - eps * direction
        numeric = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        analytic = float(np.sum(grads[idx] * direction))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (idx, numeric, analytic)


def test_fully_masked_rows_give_zero_without_warnings():
    rng = np.random.default_rng(7)
    q, k, v = random_case(rng, b=2, hq=2, hkv=2, tq=3, tk=4, d=4)
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse, w = qkv.attention(q, k, v, mask=mask, return_lse=True, return_weights=True,
                                    kv_lengths=np.array([4, 0]))
        dq, dk, dv = qkv.attention_backward(np.ones_like(out), q, k, v, out, lse, mask=mask,
                                            kv_lengths=np.array([4, 0]))
    assert np.isfinite(out).all() and np.isfinite(dq).all() and np.isfinite(dk).all()
    np.testing.assert_array_equal(out[:, :, 1], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(w[:, :, 1], 0.0)
    assert (lse[:, :, 1] == -np.inf).all() and (lse[1] == -np.inf).all()
    np.testing.assert_array_equal(dq[:, :, 1], 0.0)
    np.testing.assert_array_equal(dq[1], 0.0)
    np.testing.assert_array_equal(dk[1], 0.0)
    np.testing.assert_array_equal(dv[1], 0.0)


def test_kv_lengths_padding_is_never_read():
    rng = np.random.default_rng(8)
    q, k, v = random_case(rng, b=2, hq=2, hkv=2, tq=3, tk=6, d=4)
    lens = np.array([4, 2])
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 4:], v2[0, :, 4:] = np.nan, np.inf
    k2[1, :, 2:], v2[1, :, 2:] = 1e30, np.nan
    out, lse = qkv.attention(q, k, v, kv_lengths=lens, return_lse=True)
    out2, lse2 = qkv.attention(q, k2, v2, kv_lengths=lens, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)
    grads = qkv.attention_backward(np.ones_like(out), q, k2, v2, out2, lse2, kv_lengths=lens)
    for g in grads:
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(grads[1][0, :, 4:], 0.0)
    np.testing.assert_array_equal(grads[2][1, :, 2:], 0.0)


def test_nan_inputs_reach_the_rows_they_touch():
    rng = np.random.default_rng(9)
    q, k, v = random_case(rng, b=1, hq=1, hkv=1, tq=4, tk=4, d=4)
    q[0, 0, 2, 1] = np.nan
    out = qkv.attention(q, k, v)
    assert np.isnan(out[0, 0, 2]).all()
    assert np.isfinite(np.delete(out[0, 0], 2, axis=0)).all()
    v[0, 0, 1, 0] = np.nan  # a value every row reads
    assert np.isnan(qkv.attention(q, k, v)[0, 0, :, 0]).all()


def test_scores_of_plus_minus_1e4_do_not_overflow():
    q = np.array([[100.0, 0.0], [-100.0, 0.0]])
    k = np.array([[100.0, 0.0], [-100.0, 0.0], [0.0, 1.0]])
    v = np.eye(3)
    out = qkv.attention(q, k, v, scale=1.0)  # scores ±1e4
    np.testing.assert_allclose(out, [[1, 0, 0], [0, 1, 0]], atol=1e-12)
    out32 = qkv.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), scale=1.0)
    assert np.isfinite(out32).all()


def test_return_weights_are_the_softmax_of_the_scores():
    rng = np.random.default_rng(10)
    q, k, v = random_case(rng, b=1, hq=2, hkv=2, tq=3, tk=5, d=4)
    out, lse, w = qkv.attention(q, k, v, causal="bottom_right", return_lse=True, return_weights=True)
    np.testing.assert_allclose(w @ v, out, rtol=1e-12)
    np.testing.assert_allclose(w.sum(-1), 1.0)
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    np.testing.assert_allclose(lse[..., 0], qkv.logsumexp(s[..., 0, :3]), rtol=1e-12)


@pytest.mark.parametrize("method", ["auto", "flash", "reference"])
def test_weights_beside_a_kernel_keep_hidden_keys_out(method):
    # the weights that method="auto"/"flash" take from the dense path beside their kernel go
    # through the same guard: a NaN in k and v at a key a -inf bias hides from every row but
    # the last reaches the last row only, in the output and in the weights
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    k[0, 0, 5, 1] = np.nan
    v[0, 0, 5, 2] = np.nan
    bias = np.zeros((6, 6), np.float32)
    bias[:5, 5] = -np.inf
    out, w = qkv.attention(q, k, v, bias=bias, return_weights=True, method=method)
    bad = np.zeros((1, 2, 6), bool)
    bad[0, 0, 5] = True
    assert np.array_equal(np.isnan(out).any(axis=-1), bad)
    assert np.array_equal(np.isnan(w).any(axis=-1), bad)
    ref = qkv.attention(q.astype(np.float64), np.nan_to_num(k, nan=0.0).astype(np.float64), v.astype(np.float64),
                        bias=bias, return_weights=True, method="reference")[1]
    assert np.allclose(w[~bad], ref[~bad], atol=1e-6)
