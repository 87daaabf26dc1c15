"""qkv.nn.BaseConv and ConvAttention (Zoology's conv-then-attention): the definition, gradients, cache."""
import numpy as np
import pytest

from qkv import ShapeError, nn

from helpers import worst

TOL = 1e-6  # finite differences in float64 agree to ~1e-9; anything wrong is O(1)


def rng(seed=0):
    return np.random.default_rng(seed)


def base_conv_by_loop(layer: nn.BaseConv, u: np.ndarray) -> np.ndarray:
    """``y_t = (b + Σ_j w[:, j] ∘ u_{t-K+1+j}) ∘ (u_t W_proj + b_proj) + u_t``, one t at a time."""
    w, b = layer.params["conv_weight"], layer.params["conv_bias"]
    W, bp = layer.params["W_proj"], layer.params["b_proj"]
    K = w.shape[1]
    y = np.empty_like(u)
    for t in range(u.shape[1]):
        c = b + sum(w[:, j] * u[:, t - K + 1 + j] for j in range(K) if t - K + 1 + j >= 0)
        y[:, t] = c * (u[:, t] @ W + bp) + u[:, t]
    return y


def conv_attention(d=8, heads=2, kernel=3, seed=0, **kw) -> nn.ConvAttention:
    attn = nn.MultiHeadAttention(d, heads, causal=True, rope=True, bias=True, dtype=np.float64, rng=rng(seed), **kw)
    return nn.ConvAttention(attn, kernel, rng=rng(seed + 1))


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_base_conv_is_its_definition_and_its_gradients_match(kernel):
    layer = nn.BaseConv(6, kernel, dtype=np.float64, rng=rng(kernel))
    layer.params["b_proj"][...] = rng(9).standard_normal(6)
    u = rng(1).standard_normal((2, 7, 6))
    np.testing.assert_allclose(layer.forward(u), base_conv_by_loop(layer, u), rtol=0, atol=1e-12)
    np.testing.assert_allclose(layer.forward(u[0]), base_conv_by_loop(layer, u[:1])[0], rtol=0, atol=1e-12)
    err, name = worst(nn.gradient_errors(layer, u))
    assert err < TOL, name
    err, name = worst(nn.gradient_errors(layer, u[1]))              # 2-D (T, d_model)
    assert err < TOL, name
    assert set(layer.params) == set(layer.grads) == {"W_proj", "b_proj", "conv_weight", "conv_bias"}


def test_base_conv_matches_torchs_depthwise_conv1d():
    torch = pytest.importorskip("torch", reason="the parity check needs torch")
    layer = nn.BaseConv(5, 3, dtype=np.float64, rng=rng(2))
    u = rng(3).standard_normal((2, 6, 5))
    conv = torch.nn.Conv1d(5, 5, 3, groups=5, padding=2, dtype=torch.float64)
    with torch.no_grad():
        conv.weight[:, 0, :] = torch.from_numpy(layer.params["conv_weight"])
        conv.bias[:] = torch.from_numpy(layer.params["conv_bias"])
        ut = torch.from_numpy(u)
        c = conv(ut.transpose(1, 2))[..., :6].transpose(1, 2)      # Zoology's BaseConv: cut to the first T
        ref = c * (ut @ torch.from_numpy(layer.params["W_proj"]) + torch.from_numpy(layer.params["b_proj"])) + ut
    np.testing.assert_allclose(layer.forward(u), ref.numpy(), rtol=0, atol=1e-12)


def test_conv_attention_gradients_with_padding():
    layer = conv_attention()
    x = rng(4).standard_normal((2, 6, 8))
    err, name = worst(nn.gradient_errors(layer, x, kv_lengths=np.array([6, 4])))
    assert err < TOL, name
    assert list(layer.params)[:4] == ["short_conv.W_proj", "short_conv.b_proj", "short_conv.conv_weight",
                                      "short_conv.conv_bias"] and "W_O" in layer.params


def test_conv_attention_is_the_attention_of_the_conv():
    layer = conv_attention(kernel=2)
    x = rng(5).standard_normal((2, 5, 8))
    np.testing.assert_array_equal(layer.forward(x), layer.attn.forward(layer.short_conv.forward(x)))


def test_a_ragged_prefill_then_decoding_equals_each_sequence_alone():
    layer = conv_attention(kernel=3)
    x = rng(6).standard_normal((2, 7, 8))
    lengths = np.array([5, 2])
    cache = layer.new_cache(2, 9)
    first = layer.forward(x[:, :5], cache=cache, q_lengths=lengths)
    np.testing.assert_array_equal(cache.conv[1], x[1, :2])              # its last K-1 = 2 real inputs
    np.testing.assert_array_equal(cache.conv[0], x[0, 3:5])
    steps = [layer.forward(x[:, t:t + 1], cache=cache) for t in range(5, 7)]
    for b, n in enumerate(lengths):
        alone = np.concatenate([x[b, :n], x[b, 5:7]])[None]               # its prompt, then the two tokens
        want = layer.forward(alone)[0]
        np.testing.assert_allclose(first[b, :n], want[:n], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.concatenate([s[b] for s in steps]), want[n:], rtol=0, atol=1e-12)
    assert cache.lengths.tolist() == [7, 4]
    cache.reset()
    assert cache.length == 0 and not cache.conv.any()


def test_a_failed_call_leaves_the_cache_as_it_was_and_bad_caches_are_refused():
    layer = conv_attention(kernel=4)
    x = rng(7).standard_normal((1, 4, 8))
    cache = layer.new_cache(1, 5)
    layer.forward(x[:, :3], cache=cache)
    conv, lengths = cache.conv.copy(), cache.lengths.copy()
    with pytest.raises(ShapeError, match="the KV cache is full"):
        layer.forward(x, cache=cache)
    np.testing.assert_array_equal(cache.conv, conv)
    assert cache.lengths.tolist() == lengths.tolist() and cache.conv.shape == (1, 3, 8)
    with pytest.raises(ShapeError, match=r"cache must come from this layer's new_cache.*got KVCache"):
        layer.forward(x, cache=layer.attn.new_cache(1, 5))
    with pytest.raises(ShapeError, match=r"window must have shape \(B, K-1, d_model\) = \(1, 3, 8\)"):
        layer.short_conv.forward(x, window=np.zeros((1, 2, 8)))
    with pytest.raises(ShapeError, match="attn must be a qkv.nn.MultiHeadAttention"):
        nn.ConvAttention(nn.LinearAttention(8, 2, causal=True), 3)
    with pytest.raises(ShapeError, match="kernel must be"):
        nn.BaseConv(8, 0)
