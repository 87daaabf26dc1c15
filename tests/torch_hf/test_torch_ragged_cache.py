"""qkv.torch.MultiHeadAttention's KV cache holds a length per sequence, as qkv.nn's does: a
batch of prompts of different lengths is prefilled together (right-padded, q_lengths), then
decoded one token per sequence per step. Every step equals the NumPy layer on its own ragged
cache (same weights, float64, 1e-12) and every sequence equals its own uncached full pass;
errors are the NumPy layer's, word for word (the same checks make them)."""
import numpy as np
import pytest

import qkv
from qkv import nn as qnn

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
qt = pytest.importorskip("qkv.torch")

LENGTHS = [3, 9, 1, 17]
STEPS = 12
D_MODEL = 32
CONFIGS = {
    "gqa-rope-alibi": dict(n_kv_heads=2, rope=True, alibi=True),
    "window-chunk-bias": dict(window=5, chunk=8, bias=True),
    "mqa-rope-window": dict(n_kv_heads=1, rope=True, rope_base=500.0, window=(4, 0)),
}


def pair(kind, dtype=np.float64, seed=1):
    """The NumPy layer (random biases too) and its torch twin with the same weights."""
    rng = np.random.default_rng(seed)
    layer = qnn.MultiHeadAttention(D_MODEL, 4, causal=True, dtype=dtype, rng=rng, **CONFIGS[kind])
    for name in layer.params:
        if name.startswith("b_"):
            layer.params[name][...] = rng.standard_normal(layer.params[name].shape)
    return layer, qt.MultiHeadAttention.from_numpy(layer)


def ragged_inputs(dtype=np.float64, pad=np.nan):
    """Prompts of LENGTHS right-padded into one batch (padding rows hold ``pad``) and the next tokens."""
    rng = np.random.default_rng(10)
    prompts = [rng.standard_normal((n, D_MODEL)).astype(dtype) for n in LENGTHS]
    tokens = rng.standard_normal((len(LENGTHS), STEPS, D_MODEL)).astype(dtype)
    padded = np.full((len(LENGTHS), max(LENGTHS), D_MODEL), pad, dtype)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    return prompts, padded, tokens


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_ragged_cache_equals_the_numpy_layer_step_by_step_and_each_sequence_alone(kind):
    layer, mod = pair(kind)
    prompts, padded, tokens = ragged_inputs()  # NaN padding: never read
    n = np.array(LENGTHS)
    np_cache = layer.new_cache(len(LENGTHS), max(LENGTHS) + STEPS)
    cache = mod.new_cache(len(LENGTHS), max(LENGTHS) + STEPS)
    with torch.no_grad():
        prefill = mod(torch.from_numpy(padded), q_lengths=torch.from_numpy(n), cache=cache).numpy()
        np.testing.assert_allclose(prefill, layer.forward(padded, q_lengths=n, cache=np_cache), atol=1e-12, rtol=0)
        np.testing.assert_array_equal(cache.lengths, LENGTHS)
        assert cache.ragged and cache.length == max(LENGTHS)
        steps = []
        for s in range(STEPS):
            steps.append(mod(torch.from_numpy(tokens[:, s:s + 1]), cache=cache).numpy())
            np.testing.assert_allclose(steps[-1], layer.forward(tokens[:, s:s + 1], cache=np_cache),
                                       atol=1e-12, rtol=0, err_msg=f"step {s}")
            np.testing.assert_array_equal(cache.lengths, np_cache.lengths)
        for b, t in enumerate(LENGTHS):  # each sequence: its uncached causal pass over prompt + tokens
            whole = np.concatenate([prompts[b], tokens[b]])
            full = mod(torch.from_numpy(whole)).numpy()  # (t + STEPS, d_model)
            np.testing.assert_allclose(prefill[b, :t], full[:t], atol=1e-12, rtol=0)
            np.testing.assert_allclose(np.stack([y[b, 0] for y in steps]), full[t:], atol=1e-12, rtol=0)
    for name in ("k", "v"):  # what is stored matches, sequence by sequence (a window's: its last keys, in order)
        for b, (t, h) in enumerate(zip(np_cache.lengths, np_cache.held)):
            np.testing.assert_allclose(cache[name][b, :, t - h:t].numpy(), np_cache[name][b, :, :h], atol=1e-12, rtol=0)


def test_ragged_float32_equals_the_numpy_layer():
    layer, mod = pair("gqa-rope-alibi", dtype=np.float32)
    _, padded, tokens = ragged_inputs(np.float32)
    n = np.array(LENGTHS)
    np_cache, cache = layer.new_cache(4, 32), mod.new_cache(4, 32)
    with torch.no_grad():
        for x, q_len in ((padded, n), (tokens[:, :1], None), (tokens[:, 1:2], None)):
            y = mod(torch.from_numpy(x), q_lengths=None if q_len is None else torch.from_numpy(q_len), cache=cache)
            np.testing.assert_allclose(y.numpy(), layer.forward(x, q_lengths=q_len, cache=np_cache), atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gqa-rope-alibi", "window-chunk-bias"])
def test_ragged_gradients_equal_the_numpy_layer(kind):
    # with grad on, this call's tokens keep their graph and the stored ones are constants,
    # which is what the NumPy layer's backward computes
    layer, mod = pair(kind)
    _, padded, tokens = ragged_inputs(pad=0.0)
    n = np.array(LENGTHS)
    np_cache, cache = layer.new_cache(4, 32), mod.new_cache(4, 32)
    rng = np.random.default_rng(4)
    for x, q_len in ((padded, n), (tokens[:, :1], None), (tokens[:, 1:3], np.array([2, 0, 1, 2]))):
        mod.zero_grad()
        xt = torch.from_numpy(x).requires_grad_(True)
        y = mod(xt, q_lengths=None if q_len is None else torch.from_numpy(q_len), cache=cache)
        y_np = layer.forward(x, q_lengths=q_len, cache=np_cache)
        np.testing.assert_allclose(y.detach().numpy(), y_np, atol=1e-12, rtol=0)
        dy = rng.standard_normal(y_np.shape)
        y.backward(torch.from_numpy(dy))
        np.testing.assert_allclose(xt.grad.numpy(), layer.backward(dy), atol=1e-12, rtol=0)
        for attr, name in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V"), ("o_proj", "O")):
            np.testing.assert_allclose(getattr(mod, attr).weight.grad.numpy().T, layer.grads["W_" + name],
                                       atol=1e-12, rtol=0, err_msg=name)
    np.testing.assert_array_equal(cache.lengths, np_cache.lengths)


def raised(fn) -> str:
    with pytest.raises(qkv.ShapeError) as err:
        fn()
    return str(err.value)


def test_a_full_sequence_is_named_and_nothing_is_written():
    layer = qnn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=np.random.default_rng(0))
    mod = qt.MultiHeadAttention.from_numpy(layer)
    np_cache, cache = layer.new_cache(2, 5), mod.new_cache(2, 5)
    layer.forward(np.ones((2, 4, 8)), q_lengths=np.array([4, 1]), cache=np_cache)
    with torch.no_grad():
        mod(torch.ones(2, 4, 8, dtype=torch.float64), q_lengths=torch.tensor([4, 1]), cache=cache)
    before = {name: cache[name].clone() for name in ("k", "v")}
    message = raised(lambda: mod(torch.ones(2, 2, 8, dtype=torch.float64), cache=cache))
    assert "sequence 0 holds 4 of max_len = 5 tokens and cannot take 2 more" in message
    assert message == raised(lambda: layer.forward(np.ones((2, 2, 8)), cache=np_cache))
    np.testing.assert_array_equal(cache.lengths, [4, 1])
    for name, value in before.items():
        torch.testing.assert_close(cache[name], value, rtol=0, atol=0)
    # with grad on too (the other path through the cache)
    message = raised(lambda: mod(torch.ones(2, 2, 8, dtype=torch.float64, requires_grad=True), cache=cache))
    assert "cannot take 2 more" in message
    np.testing.assert_array_equal(cache.lengths, [4, 1])
    torch.testing.assert_close(cache["k"], before["k"], rtol=0, atol=0)


def test_cache_call_errors_are_the_numpy_layers():
    layer = qnn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=np.random.default_rng(0))
    mod = qt.MultiHeadAttention.from_numpy(layer)
    np_cache, cache = layer.new_cache(2, 6), mod.new_cache(2, 6)
    layer.forward(np.ones((2, 2, 8)), q_lengths=np.array([2, 1]), cache=np_cache)
    with torch.no_grad():
        mod(torch.ones(2, 2, 8, dtype=torch.float64), q_lengths=torch.tensor([2, 1]), cache=cache)
    x, xt = np.ones((2, 1, 8)), torch.ones(2, 1, 8, dtype=torch.float64)
    cases = {
        "q_lengths past T": (dict(q_lengths=np.array([2, 1])), "q_lengths must be ints in [0, T]"),
        "q_lengths shape": (dict(q_lengths=np.array([1])), "q_lengths must be ints in [0, T]"),
        "kv_lengths": (dict(kv_lengths=np.array([2, 1])), "kv_lengths= is not taken with cache="),
    }
    for case, (kw, words) in cases.items():
        tkw = {k: torch.from_numpy(v) for k, v in kw.items()}
        message = raised(lambda: mod(xt, cache=cache, **tkw))
        assert words in message, case
        assert message == raised(lambda: layer.forward(x, cache=np_cache, **kw)), case
    np.testing.assert_array_equal(cache.lengths, [2, 1])
    other = qt.MultiHeadAttention(8, 2, n_kv_heads=1, causal=True, dtype=torch.float64)
    assert "cache 'k' must be torch.float64 (B, 1, max_len, 4) for this layer" in raised(
        lambda: other(xt, cache=cache))
    assert raised(lambda: mod(xt, cache=np_cache)) == \
        "cache must come from this layer's new_cache(batch, max_len); got KVCache"
    assert "cache must come from this layer's new_cache" in raised(lambda: layer.forward(x, cache=cache))


def test_uniform_cache_calls_are_bit_identical_to_the_unpadded_path():
    mod = qt.MultiHeadAttention(16, 4, n_kv_heads=1, rope=True, causal=True)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(6))
    a, b = mod.new_cache(3, 10), mod.new_cache(3, 10)
    with torch.no_grad():
        ya = mod(x, cache=a)
        yb = mod(x, q_lengths=torch.tensor([7, 7, 7]), cache=b)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    assert not a.ragged and a.length == 7 and list(a.lengths) == [7, 7, 7]
    assert repr(a).startswith("KVCache(7/10 tokens, k (3, 1, 10, 4)")
    a.reset()
    assert a.length == 0 and a.nbytes == 2 * 3 * 10 * 4 * 4
