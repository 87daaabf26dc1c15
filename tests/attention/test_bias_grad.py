"""A learned bias's gradient (``attention_backward(..., return_dbias=True)``): dS summed over the
bias's broadcast axes, against central differences in float64 and against torch's autograd
through an eager implementation, on every kernel, with every option that changes dS."""
import numpy as np
import pytest

import qkv

B, H, HKV, TQ, TK, D = 2, 4, 2, 5, 7, 3
METHODS = ["reference", "flash", "auto"]
# bias shapes that broadcast to (B, H, Tq, Tk) along different axes
SHAPES = [(B, H, TQ, TK), (1, H, TQ, TK), (B, 1, TQ, TK), (TQ, TK), (H, 1, TK), (B, H, TQ, 1)]
OPTIONS = [
    {},
    dict(causal=True),
    dict(causal="bottom_right", window=(2, 0)),
    dict(softcap=1.5, scale=0.9),
    dict(dropout_p=0.3, dropout_seed=11),
    dict(kv_lengths=np.array([7, 4]), q_lengths=np.array([5, 3]), causal="bottom_right"),
    dict(mask=(np.arange(TK) % 3 != 1)[None, :], chunk=3),
]


def _inputs(shape, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, TQ, D))
    k, v = rng.standard_normal((B, HKV, TK, D)), rng.standard_normal((B, HKV, TK, D + 1))
    bias = rng.standard_normal(shape)
    dout, dlse = rng.standard_normal((B, H, TQ, D + 1)), rng.standard_normal((B, H, TQ))
    return [x.astype(dtype) for x in (q, k, v, bias, dout, dlse)]


def _loss(q, k, v, bias, dout, dlse, opts, method="reference"):
    out, lse = qkv.attention(q, k, v, bias=bias, gqa=True, return_lse=True, method=method, **opts)
    return float(np.sum(dout * out) + np.sum(np.where(np.isfinite(lse), dlse * lse, 0)))


def _grads(q, k, v, bias, dout, dlse, opts, method):
    out, lse = qkv.attention(q, k, v, bias=bias, gqa=True, return_lse=True, method=method, **opts)
    return qkv.attention_backward(dout, q, k, v, out, lse, dlse=dlse, bias=bias, gqa=True, method=method,
                                  return_dbias=True, **opts)


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dbias_equals_central_differences(shape, opts):
    q, k, v, bias, dout, dlse = _inputs(shape)
    dbias = _grads(q, k, v, bias, dout, dlse, opts, "reference")[3]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    h, numeric = 1e-6, np.zeros_like(bias)
    for i in np.ndindex(bias.shape):
        up, down = bias.copy(), bias.copy()
        up[i] += h
        down[i] -= h
        numeric[i] = (_loss(q, k, v, up, dout, dlse, opts) - _loss(q, k, v, down, dout, dlse, opts)) / (2 * h)
    np.testing.assert_allclose(dbias, numeric, atol=1e-8, rtol=1e-6)
    assert np.abs(dbias).max() > 1e-3  # the loss does depend on the bias here


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_every_kernel_gives_the_references_dbias_and_the_same_dq_dk_dv(opts, method):
    q, k, v, bias, dout, dlse = _inputs((1, H, TQ, TK), seed=1)
    want = _grads(q, k, v, bias, dout, dlse, opts, "reference")
    got = _grads(q, k, v, bias, dout, dlse, opts, method)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-12, rtol=1e-10)
    out, lse = qkv.attention(q, k, v, bias=bias, gqa=True, return_lse=True, method=method, **opts)
    plain = qkv.attention_backward(dout, q, k, v, out, lse, dlse=dlse, bias=bias, gqa=True, method=method, **opts)
    assert len(plain) == 3
    for g, w in zip(plain, got):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("method", METHODS)
def test_float32_dbias_is_within_twice_the_dense_float32_error(method):
    x64 = _inputs((1, H, TQ, TK), seed=2)
    want = _grads(*x64, {}, "reference")[3]
    x32 = [x.astype(np.float32) for x in x64]
    dense = _grads(*x32, {}, "reference")[3]
    got = _grads(*x32, {}, method)[3]
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 2 * np.abs(dense - want).max() + 1e-7


def test_dbias_against_torch_autograd_of_eager_attention():
    torch = pytest.importorskip("torch", reason="the autograd oracle needs PyTorch: pip install -e '.[torch]'")
    q, k, v, bias, dout, _ = _inputs((1, H, TQ, TK), seed=3)
    cap, scale = 2.0, 0.7
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    kx, vx = (x.repeat_interleave(H // HKV, dim=1) for x in t[1:3])
    s = cap * torch.tanh(t[0] @ kx.transpose(-1, -2) * scale / cap) + t[3]
    s = s.masked_fill(~torch.ones(TQ, TK, dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(s, dim=-1) @ vx).backward(torch.tensor(dout))
    opts = dict(causal=True, softcap=cap, scale=scale, gqa=True)
    out, lse = qkv.attention(q, k, v, bias=bias, return_lse=True, **opts)
    for method in METHODS:
        got = qkv.attention_backward(dout, q, k, v, out, lse, bias=bias, return_dbias=True, method=method, **opts)
        for g, want in zip(got, t):
            np.testing.assert_allclose(g, want.grad.numpy(), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("method", METHODS)
def test_a_hidden_keys_nan_value_never_reaches_dbias(method):
    q, k, v, bias, dout, dlse = _inputs((B, H, TQ, TK), seed=4)
    opts = dict(kv_lengths=np.array([4, 6]), causal=True)
    v[0, :, 5], v[1, :, 6] = np.nan, np.inf   # past each item's length
    dbias = _grads(q, k, v, bias, dout, dlse, opts, method)[3]
    assert np.isfinite(dbias).all()
    assert (dbias[0, :, :, 4:] == 0).all() and (np.triu(dbias[1, 0], 1) == 0).all()


def test_return_dbias_without_a_bias_or_not_a_bool_is_a_clear_error():
    q, k, v, bias, dout, _ = _inputs((TQ, TK))
    out, lse = qkv.attention(q, k, v, gqa=True, return_lse=True)
    with pytest.raises(qkv.ShapeError, match="return_dbias=True needs the bias="):
        qkv.attention_backward(dout, q, k, v, out, lse, gqa=True, return_dbias=True)
    with pytest.raises(qkv.OptionError, match="return_dbias must be True or False; got 1"):
        qkv.attention_backward(dout, q, k, v, out, lse, gqa=True, bias=bias, return_dbias=1)


def test_a_prepared_call_runs_forward_and_backward_as_the_two_functions():
    """qkv.api.prepare_call: the checks once, then the same results as qkv.attention and
    qkv.attention_backward (a call prepared for the weights too has a backward)."""
    from qkv import api

    q, k, v, bias, dout, dlse = _inputs((1, H, TQ, TK), seed=5)
    opts = dict(bias=bias, gqa=True, causal=True, method="flash")
    for weights in (False, True):
        call = api.prepare_call(q, k, v, return_weights=weights, **opts)
        got = call.forward(return_lse=True, return_weights=weights)
        want = qkv.attention(q, k, v, return_lse=True, return_weights=weights, **opts)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        grads = call.backward(dout, *got[:2], dlse=dlse, return_dbias=True)
        for a, b in zip(grads, qkv.attention_backward(dout, q, k, v, *want[:2], dlse=dlse, return_dbias=True, **opts)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(qkv.ShapeError, match=r"dout must have shape \(\.\.\., Hq, Tq, Dv\)"):
        call.backward(dout[:, :1], *got[:2])
    with pytest.raises(qkv.OptionError, match="unknown keyword argument flavour"):
        api.prepare_call(q, k, v, gqa=True, flavour=1)
