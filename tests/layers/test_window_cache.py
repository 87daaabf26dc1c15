"""A windowed attention layer's KV cache keeps only the keys a later query can see (a ring of
the last W, qkv.nn.cache): decoding through it equals the uncached full pass (float64, 1e-12)
for prompts shorter and longer than the window, for many steps past it, for multi-token steps
that wrap the ring, for a ragged batch, behind Zoology's short convolution and in a GPT (the
griffin pattern and windowed attention alone), while its bytes stay flat in the context."""
import numpy as np
import pytest

from qkv import ShapeError, nn
from qkv.models import GPT, GPTConfig

W = 4
D_MODEL = 16


def rng(seed):
    return np.random.default_rng(seed)


def windowed(window=W, seed=1, **kw):
    opts = dict(n_kv_heads=2, rope=True, rope_base=100.0) | kw
    return nn.MultiHeadAttention(D_MODEL, 4, causal=True, window=window, dtype=np.float64, rng=rng(seed), **opts)


def decode(layer, x, cache, sizes):
    """``x (B, T, d_model)`` through ``cache`` in calls of ``sizes`` rows each; the outputs joined."""
    outs, at = [], 0
    for n in sizes:
        outs.append(layer.forward(x[:, at:at + n], cache=cache))
        at += n
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("opts", [{}, dict(alibi=True, rope=False), dict(n_kv_heads=1, bias=True)],
                         ids=["gqa-rope", "alibi", "mqa-bias"])
@pytest.mark.parametrize("prompt", [2, W, 11])     # shorter than, as long as, longer than the window
def test_prefill_then_steps_equals_the_whole_sequence(prompt, opts):
    layer = windowed(**opts)
    x = rng(2).standard_normal((2, prompt + 3 * W + 1, D_MODEL))
    full = layer.forward(x)
    cache = layer.new_cache(2, x.shape[1])
    got = decode(layer, x, cache, [prompt] + [1] * (x.shape[1] - prompt))
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-12)
    assert cache.slots == W and cache.arrays["k"].shape == (2, layer.n_kv_heads, W, layer.d_head)


@pytest.mark.parametrize("window", [1, 3, (5, 0), 0])
def test_multi_token_steps_that_wrap_the_ring(window):
    layer = windowed(window)
    x = rng(3).standard_normal((1, 23, D_MODEL))
    cache = layer.new_cache(1, 23)
    got = decode(layer, x, cache, [3, 2, 5, 1, 7, 1, 4])
    np.testing.assert_allclose(got, layer.forward(x), rtol=0, atol=1e-12)


def test_the_kept_keys_are_the_last_w_rotated_at_their_own_positions():
    layer = windowed()
    x = rng(4).standard_normal((2, 13, D_MODEL))
    ring, whole = layer.new_cache(2, 13), nn.KVCache(2, 2, 13, layer.d_head, np.float64)  # every key kept
    for cache in (ring, whole):
        decode(layer, x, cache, [6, 1, 1, 3, 1, 1])
    assert ring.held.tolist() == [W, W] and ring.lengths.tolist() == [13, 13]
    for name in ("k", "v"):
        np.testing.assert_array_equal(ring[name], whole[name][:, :, 13 - W:])


def test_the_bytes_are_flat_in_the_context():
    layer = windowed()
    per_token = 2 * layer.n_kv_heads * layer.d_head * 8       # k and v, float64
    sizes = [layer.new_cache(3, n).nbytes for n in (2, W, 100, 10_000)]
    assert sizes == [3 * 2 * per_token, 3 * W * per_token, 3 * W * per_token, 3 * W * per_token]
    assert layer.new_cache(3, 100).bytes_per_token == layer.cache_bytes_per_token() == per_token
    chunked = nn.MultiHeadAttention(D_MODEL, 4, causal=True, window=W, chunk=8)   # chunks count from key 0
    assert chunked.new_cache(1, 50).window is None and chunked.new_cache(1, 50).slots == 50
    assert nn.MultiHeadAttention(D_MODEL, 4, causal=True).new_cache(1, 50).slots == 50


def test_a_ragged_batch_equals_each_sequence_alone():
    layer = windowed(alibi=True)
    lengths = np.array([1, 3, 9, 17])
    x = rng(5).standard_normal((4, 17 + 12, D_MODEL))
    padded = np.where(np.arange(17)[None, :, None] < lengths[:, None, None], x[:, :17], np.nan)  # NaN: never read
    cache = layer.new_cache(4, 17 + 12)
    first = layer.forward(padded, cache=cache, q_lengths=lengths)
    chunk = layer.forward(x[:, 17:19], cache=cache, q_lengths=np.array([2, 1, 2, 0]))   # a ragged 2-token step
    steps = [layer.forward(x[:, 19 + s:20 + s], cache=cache) for s in range(10)]
    assert cache.lengths.tolist() == (lengths + [12, 11, 12, 10]).tolist()
    for b, n in enumerate(lengths):
        c = [2, 1, 2, 0][b]
        alone = np.concatenate([x[b, :n], x[b, 17:17 + c], x[b, 19:29]])
        want = layer.forward(alone[None])[0]
        np.testing.assert_allclose(first[b, :n], want[:n], rtol=0, atol=1e-12)
        np.testing.assert_allclose(chunk[b, :c], want[n:n + c], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.concatenate([s[b] for s in steps]), want[n + c:], rtol=0, atol=1e-12)


def test_a_failed_call_leaves_the_ring_as_it_was(monkeypatch):
    layer = windowed()
    x = rng(6).standard_normal((1, 12, D_MODEL))
    cache = layer.new_cache(1, 12)
    decode(layer, x, cache, [9])
    before = {n: a.copy() for n, a in cache.arrays.items()}

    def fail(*args, **kw):
        raise RuntimeError("attention failed")
    with monkeypatch.context() as m:
        m.setattr(layer, "_attend", fail)
        with pytest.raises(RuntimeError, match="attention failed"):
            layer.forward(x[:, 9:10], cache=cache)                 # wrote its key, then failed
    for n, a in cache.arrays.items():
        np.testing.assert_array_equal(a, before[n])
    assert cache.lengths.tolist() == [9]
    got = decode(layer, x[:, 9:], cache, [1, 2])
    np.testing.assert_allclose(got, layer.forward(x)[:, 9:], rtol=0, atol=1e-12)


def test_caches_that_keep_too_little_are_refused_and_a_full_one_serves():
    layer = windowed(W)
    x = rng(7).standard_normal((1, 9, D_MODEL))
    with pytest.raises(ShapeError, match="cache keeps the last 2 keys of each sequence, but this layer's query "
                                         "sees the 4 keys before its own"):
        layer.forward(x, cache=windowed(2).new_cache(1, 9))
    with pytest.raises(ShapeError, match="sees every earlier key"):
        nn.MultiHeadAttention(D_MODEL, 4, n_kv_heads=2, causal=True, dtype=np.float64).forward(
            x, cache=layer.new_cache(1, 9))
    whole = nn.KVCache(1, 2, 9, layer.d_head, np.float64)
    np.testing.assert_allclose(decode(layer, x, whole, [5, 1, 1, 2]), layer.forward(x), rtol=0, atol=1e-12)
    cache = layer.new_cache(1, 9)
    layer.forward(x, cache=cache)                          # max_len still bounds the tokens, not the slots
    with pytest.raises(ShapeError, match="KV cache is full: it holds 9 of max_len = 9 tokens"):
        layer.forward(x[:, :1], cache=cache)
    with pytest.raises(ShapeError, match="window must be an int >= 0"):
        nn.KVCache(1, 2, 9, 4, window=-1)


def test_conv_attention_with_a_window_decodes_as_the_full_pass():
    layer = nn.ConvAttention(windowed(3, seed=8), 3, rng=rng(9))
    lengths = np.array([2, 7])
    x = rng(10).standard_normal((2, 7 + 9, D_MODEL))
    cache = layer.new_cache(2, 16)
    assert isinstance(cache, nn.ConvKVCache) and cache.slots == 3
    first = layer.forward(x[:, :7], cache=cache, q_lengths=lengths)
    steps = [layer.forward(x[:, 7 + s:8 + s], cache=cache) for s in range(9)]
    for b, n in enumerate(lengths):
        want = layer.forward(np.concatenate([x[b, :n], x[b, 7:]])[None])[0]
        np.testing.assert_allclose(first[b, :n], want[:n], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.concatenate([s[b] for s in steps]), want[n:], rtol=0, atol=1e-12)
    assert cache.nbytes == layer.new_cache(2, 1000).nbytes


# --- in a GPT --------------------------------------------------------------------------------------
def gpt(layers, n_layer, block_size, seed=3):
    model = GPT(GPTConfig(vocab_size=13, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=16,
                          dtype=np.float64, positions="rope", layers=layers, seed=seed))
    for name, p in model.params.items():        # larger projections: no near ties in the greedy choices
        if p.ndim >= 2 and "conv" not in name and "gate_weight" not in name:
            p *= 4.0
    return model


CASES = {"griffin": ("griffin", 3, 128, 64), "window": (["attention:window=3"], 2, 40, 3),
         "window-conv": (["attention:window=3:conv=2", "rglru"], 2, 40, 3)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_cached_generation_equals_uncached_past_the_window(case):
    layers, n_layer, block, window = CASES[case]
    model = gpt(layers, n_layer, block)
    r = rng(11)
    prompts = [r.integers(0, 13, n) for n in (2, window + 6, window)]   # shorter, longer, as long
    new = block - max(len(p) for p in prompts)
    ids, logits = model.generate(prompts, new, temperature=0, return_logits=True)
    for k, p in enumerate(prompts):
        alone, lg = model.generate(p[None], new, temperature=0, use_cache=False, return_logits=True)
        np.testing.assert_array_equal(ids[k], alone[0])
        np.testing.assert_allclose(logits[k], lg[0], rtol=0, atol=1e-12)
    cache = model.new_cache(1, block)
    kv = [e for e in cache if isinstance(e, nn.KVCache)]
    assert kv and all(e.slots == window for e in kv)
    assert [e.nbytes for e in kv] == [e.nbytes for e in model.new_cache(1, window) if isinstance(e, nn.KVCache)]


@pytest.mark.parametrize("case", ["griffin", "window"])
def test_gpt_prefill_of_a_long_prompt_then_steps_equals_the_whole_sequence(case):
    layers, n_layer, block, window = CASES[case]
    model = gpt(layers, n_layer, block).eval()
    idx = rng(12).integers(0, 13, (2, block))
    whole = model.forward(idx)
    cache = model.new_cache(2, block)
    prompt = window + 9
    got = [model.forward(idx[:, :prompt], cache=cache)]
    got += [model.forward(idx[:, t:t + 1], cache=cache) for t in range(prompt, block)]
    np.testing.assert_allclose(np.concatenate(got, axis=1), whole, rtol=0, atol=1e-12)
    kv = [e for e in cache if isinstance(e, nn.KVCache)]
    assert all(e.lengths.tolist() == [block, block] and e.held.tolist() == [window, window] for e in kv)
