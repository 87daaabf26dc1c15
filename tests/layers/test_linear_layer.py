"""qkv.nn.LinearAttention: the textbook computation, gradients, and decoding through its state."""
import copy

import numpy as np
import pytest

import qkv
from qkv import nn


def rng(seed):
    return np.random.default_rng(seed)


OPTIONS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "causal": dict(causal=True),
    "causal_gqa_bias": dict(causal=True, n_kv_heads=2, bias=True),
    "d_head": dict(d_head=3, n_kv_heads=2),
}


def test_parameters_are_named_and_drawn_like_multihead_attention():
    lin = nn.LinearAttention(8, 4, n_kv_heads=2, bias=True, rng=rng(0))
    mha = nn.MultiHeadAttention(8, 4, n_kv_heads=2, bias=True, rng=rng(0))
    assert list(lin.params) == list(mha.params) == list(lin.grads)
    for name in lin.params:
        np.testing.assert_array_equal(lin.params[name], mha.params[name])  # same seed, same start


def test_forward_is_the_textbook_computation():
    x = rng(1).standard_normal((2, 5, 8))
    layer = nn.LinearAttention(8, 2, causal=True, dtype=np.float64, rng=rng(2))
    p = layer.params
    q, k, v = (x @ p["W_" + n] for n in "QKV")
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        phi_q, phi_k = (np.where(a[..., sl] > 0, a[..., sl] + 1, np.exp(np.minimum(a[..., sl], 0))) for a in (q, k))
        w = np.tril(phi_q @ np.swapaxes(phi_k, -1, -2))
        heads.append(w / w.sum(-1, keepdims=True) @ v[..., sl])
    np.testing.assert_allclose(layer.forward(x), np.concatenate(heads, -1) @ p["W_O"], rtol=1e-10)
    _, weights = layer.forward(x, return_weights=True)
    assert weights.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-12)
    assert np.all(np.triu(weights[0, 0], 1) == 0)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_self_attention_gradients(name):
    layer = nn.LinearAttention(8, 4, dtype=np.float64, rng=rng(3), **OPTIONS[name])
    errors = nn.gradient_errors(layer, rng(4).standard_normal((2, 5, 8)))
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_cross_attention_gradients(name):
    layer = nn.LinearAttention(8, 4, dtype=np.float64, rng=rng(5), **OPTIONS[name])
    x, c = rng(6).standard_normal((2, 4, 8)), rng(7).standard_normal((2, 7, 8))
    errors = nn.gradient_errors(layer, x, c)
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("name", ["causal", "causal_gqa_bias"])
def test_decoding_through_the_state_equals_the_full_causal_pass(name):
    x = rng(8).standard_normal((2, 11, 8))
    layer = nn.LinearAttention(8, 4, dtype=np.float64, rng=rng(9), **OPTIONS[name])
    full = layer.forward(x)
    state = layer.new_state(batch=2)
    before = state.nbytes
    steps = [layer.forward(x[:, :4], state=state)]  # a prefill, then one token at a time
    steps += [layer.forward(x[:, t:t + 1], state=state) for t in range(4, 11)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-14)
    assert state.length == 11 and state.nbytes == before  # constant size
    state.reset()
    assert state.length == 0 and not state.s.any()


def test_float32_decoding_stays_close_to_the_float64_pass():
    x = rng(10).standard_normal((1, 300, 16))
    layer64 = nn.LinearAttention(16, 2, causal=True, dtype=np.float64, rng=rng(11))
    layer32 = nn.LinearAttention(16, 2, causal=True, dtype=np.float32, rng=rng(11))
    full = layer64.forward(x)
    state = layer32.new_state(1)
    steps = np.concatenate([layer32.forward(x[:, t:t + 1], state=state) for t in range(300)], axis=1)
    assert steps.dtype == np.float32
    assert np.abs(steps - full).max() < 1e-5 * np.abs(full).max()


def test_backward_after_a_stateful_step_treats_the_state_as_constant():
    layer = nn.LinearAttention(8, 4, n_kv_heads=2, causal=True, dtype=np.float64, rng=rng(12))
    x = rng(13).standard_normal((2, 6, 8))
    state = layer.new_state(2)
    layer.forward(x[:, :3], state=state)

    class FromState:  # each forward starts from a copy of the same state
        params, grads = layer.params, layer.grads

        def forward(self, xx):
            return layer.forward(xx, state=copy.deepcopy(state))

        def backward(self, dy):
            return layer.backward(dy)

    errors = nn.gradient_errors(FromState(), np.ascontiguousarray(x[:, 3:]))
    assert max(errors.values()) < 1e-6, errors


def test_two_dimensional_input_and_float16_layers():
    layer = nn.LinearAttention(8, 2, causal=True, dtype=np.float16, rng=rng(14))
    y = layer.forward(rng(15).standard_normal((5, 8)))
    assert y.shape == (5, 8) and y.dtype == np.float16 and np.isfinite(y).all()
    assert layer.backward(np.ones((5, 8))).shape == (5, 8)
    assert layer.new_state(1).s.dtype == np.float32  # float16 computes in float32


def test_misuse_is_named():
    layer = nn.LinearAttention(8, 2, causal=True, rng=rng(16))
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(qkv.ShapeError, match="n_heads must be a multiple of n_kv_heads"):
        nn.LinearAttention(8, 4, n_kv_heads=3)
    with pytest.raises(qkv.ShapeError, match="causal must be"):
        nn.LinearAttention(8, 2, causal="left")
    with pytest.raises(qkv.ShapeError, match="needs a causal layer"):
        nn.LinearAttention(8, 2, rng=rng(0)).forward(x, state=layer.new_state(2))
    with pytest.raises(qkv.ShapeError, match=r"new_state\(batch=2\)"):
        layer.forward(x, state=layer.new_state(3))
    with pytest.raises(qkv.ShapeError, match="state must come from"):
        layer.forward(x, state=nn.MultiHeadAttention(8, 2, causal=True).new_cache(2, 4))
    with pytest.raises(qkv.ShapeError, match="return_weights needs the keys"):
        layer.forward(x, state=layer.new_state(2), return_weights=True)
    with pytest.raises(qkv.ShapeError, match="context= and state="):
        layer.forward(x, x, state=layer.new_state(2))
    layer.forward(x)
    with pytest.raises(qkv.ShapeError, match=r"dy must have the output's shape \(B, T, d_model\) = \(2, 3, 8\)"):
        layer.backward(np.zeros((2, 3, 7)))


def test_trains_with_adam():
    """A few Adam steps on a regression target lower the loss: params and grads are wired up."""
    layer = nn.LinearAttention(8, 2, causal=True, rng=rng(17))
    x = rng(18).standard_normal((4, 6, 8)).astype(np.float32)
    target = np.roll(x, 1, axis=1)
    opt = nn.Adam([layer], lr=1e-2)
    losses = []
    for _ in range(30):
        y = layer.forward(x)
        losses.append(float(np.mean((y - target) ** 2)))
        layer.backward(2 * (y - target) / y.size)
        opt.step()
    assert losses[-1] < 0.8 * losses[0]
