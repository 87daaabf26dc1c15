"""A batch of prompts of different lengths shares one KV cache: prefilled together
(right-padded, q_lengths), then decoded one token per sequence per step; every sequence's
outputs equal running it alone."""
import numpy as np
import pytest

import qkv
from qkv import nn

LENGTHS = [3, 9, 1, 17]
STEPS = 12


def layers(dtype):
    rng = np.random.default_rng
    return {
        "gqa-rope-alibi": nn.MultiHeadAttention(32, 4, n_kv_heads=2, rope=True, alibi=True, causal=True,
                                                dtype=dtype, rng=rng(1)),
        "window-chunk-bias": nn.MultiHeadAttention(32, 4, window=5, chunk=8, bias=True, causal=True,
                                                   dtype=dtype, rng=rng(2)),
        "mla": nn.LatentAttention(32, 4, 12, d_rope=4, causal=True, dtype=dtype, rng=rng(3)),
    }


def run_alone(layer, prompt, tokens):
    """One sequence: prefill its prompt, then one token per step; the outputs of every row."""
    cache = layer.new_cache(1, len(prompt) + len(tokens))
    outs = [layer.forward(prompt[None], cache=cache)[0]]
    for tok in tokens:
        outs.append(layer.forward(tok[None, None], cache=cache)[0])
    return outs


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("kind", ["gqa-rope-alibi", "window-chunk-bias", "mla"])
def test_ragged_batch_decodes_like_each_prompt_alone(kind, dtype, tol):
    layer = layers(dtype)[kind]
    rng = np.random.default_rng(10)
    prompts = [rng.standard_normal((n, 32)).astype(dtype) for n in LENGTHS]
    tokens = rng.standard_normal((len(LENGTHS), STEPS, 32)).astype(dtype)
    tmax = max(LENGTHS)
    padded = np.full((len(LENGTHS), tmax, 32), np.nan, dtype)  # padding rows hold NaN: never read
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    cache = layer.new_cache(len(LENGTHS), tmax + STEPS)
    prefill = layer.forward(padded, q_lengths=np.array(LENGTHS), cache=cache)
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    steps = [layer.forward(tokens[:, s:s + 1], cache=cache) for s in range(STEPS)]
    np.testing.assert_array_equal(cache.lengths, np.array(LENGTHS) + STEPS)
    for b, n in enumerate(LENGTHS):
        alone = run_alone(layer, prompts[b], tokens[b])
        np.testing.assert_allclose(prefill[b, :n], alone[0], atol=tol, rtol=tol)
        assert (prefill[b, n:] == 0).all()  # padding rows: output 0 (the bias of W_O aside)
        for s in range(STEPS):
            np.testing.assert_allclose(steps[s][b], alone[s + 1], atol=tol, rtol=tol)


def test_a_full_sequence_is_named_and_nothing_is_written():
    layer = nn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=np.random.default_rng(0))
    cache = layer.new_cache(2, 5)
    layer.forward(np.ones((2, 4, 8)), q_lengths=np.array([4, 1]), cache=cache)
    before = cache["k"].copy()
    with pytest.raises(qkv.ShapeError, match="sequence 0 holds 4 of max_len = 5 tokens and cannot take 2 more"):
        layer.forward(np.ones((2, 2, 8)), cache=cache)
    np.testing.assert_array_equal(cache.lengths, [4, 1])
    np.testing.assert_array_equal(cache["k"], before)
    with pytest.raises(qkv.ShapeError, match="q_lengths"):
        layer.forward(np.ones((2, 1, 8)), q_lengths=np.array([2, 1]), cache=cache)
    with pytest.raises(qkv.ShapeError, match="kv_lengths= is not taken with cache="):
        layer.forward(np.ones((2, 1, 8)), kv_lengths=np.array([2, 1]), cache=cache)


def test_uniform_cache_calls_are_bit_identical_to_the_unpadded_path():
    layer = nn.MultiHeadAttention(16, 4, n_kv_heads=1, rope=True, causal=True, rng=np.random.default_rng(5))
    x = np.random.default_rng(6).standard_normal((3, 7, 16)).astype(np.float32)
    a, b = layer.new_cache(3, 10), layer.new_cache(3, 10)
    ya = layer.forward(x, cache=a)
    yb = layer.forward(x, q_lengths=np.array([7, 7, 7]), cache=b)
    np.testing.assert_array_equal(ya, yb)
