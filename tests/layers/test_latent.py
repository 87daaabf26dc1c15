"""qkv.nn.LatentAttention (MLA): gradients, cached decoding equal to the full pass, cache size."""
import numpy as np
import pytest

import qkv
from qkv import nn
from qkv.cli import main

TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def worst(errors):
    name = max(errors, key=errors.get)
    return errors[name], name


def test_parameters_and_default_rope_size():
    layer = nn.LatentAttention(32, 4, 16)
    shapes = {k: v.shape for k, v in layer.params.items()}
    assert shapes == {"W_Q": (32, 32), "W_DKV": (32, 16), "W_UK": (16, 32), "W_UV": (16, 32),
                      "W_O": (32, 32), "W_QR": (32, 16), "W_KR": (32, 4)}
    assert layer.d_rope == 4 and layer.scale == pytest.approx(1 / np.sqrt(12))
    assert "W_KR" not in nn.LatentAttention(32, 4, 16, d_rope=0).params


@pytest.mark.parametrize("opts", [dict(), dict(d_rope=0), dict(causal=True), dict(causal=True, window=2, d_rope=2),
                                  dict(d_head=3, d_rope=4)])
def test_gradients(opts):
    x = rng(1).standard_normal((2, 5, 8))
    layer = nn.LatentAttention(8, 2, 6, dtype=np.float64, rng=rng(2), **opts)
    err, which = worst(nn.gradient_errors(layer, x))
    assert err < TOL, which


def test_gradients_with_padding_and_two_dimensional_input():
    layer = nn.LatentAttention(8, 2, 6, causal=True, dtype=np.float64, rng=rng(3))
    err, which = worst(nn.gradient_errors(layer, rng(4).standard_normal((2, 5, 8)), kv_lengths=np.array([2, 5])))
    assert err < TOL, which
    err, which = worst(nn.gradient_errors(layer, rng(5).standard_normal((5, 8))))
    assert err < TOL, which


def test_the_full_pass_is_attention_over_up_projected_keys_and_values():
    """Expanded form written out: k = [c W_UK ; k_R], v = c W_UV, score scale 1/sqrt(D + d_rope)."""
    x = rng(6).standard_normal((1, 4, 8))
    layer = nn.LatentAttention(8, 2, 6, d_rope=2, dtype=np.float64, rng=rng(7))
    p = layer.params
    c = x @ p["W_DKV"]
    heads = []
    for h in range(2):
        q = np.concatenate([x @ p["W_Q"][:, 4 * h:4 * h + 4],
                            qkv.positional.rope(x @ p["W_QR"][:, 2 * h:2 * h + 2])], -1)
        k = np.concatenate([c @ p["W_UK"][:, 4 * h:4 * h + 4], qkv.positional.rope(x @ p["W_KR"])], -1)
        heads.append(qkv.attention(q, k, c @ p["W_UV"][:, 4 * h:4 * h + 4], method="reference"))
    np.testing.assert_allclose(layer.forward(x), np.concatenate(heads, -1) @ p["W_O"], atol=1e-12)


@pytest.mark.parametrize("d_rope", [0, 4])
def test_cached_decoding_equals_the_full_causal_pass(d_rope):
    x = rng(8).standard_normal((2, 9, 16))
    layer = nn.LatentAttention(16, 4, 8, d_rope=d_rope, causal=True, dtype=np.float64, rng=rng(9))
    full, w_full = layer.forward(x, return_weights=True)
    cache = layer.new_cache(2, 9)
    steps = [layer.forward(x[:, :3], cache=cache)]
    for t in range(3, 9):
        y, w = layer.forward(x[:, t:t + 1], cache=cache, return_weights=True)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-12)
    np.testing.assert_allclose(w[:, :, 0], w_full[:, :, -1], atol=1e-12)  # the last token's weights too


def test_cached_decoding_float32_and_window():
    x = rng(10).standard_normal((1, 7, 16)).astype(np.float32)
    layer = nn.LatentAttention(16, 2, 8, causal=True, window=3, rng=rng(11))
    full = layer.forward(x)
    cache = layer.new_cache(1, 7)
    steps = [layer.forward(x[:, t:t + 1], cache=cache) for t in range(7)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_cache_stores_latent_and_rope_key_only():
    layer = nn.LatentAttention(64, 8, 16, d_rope=4)  # d_head 8: MHA would store 2*8*8 = 128 per token
    cache = layer.new_cache(2, 10)
    assert cache.nbytes == 2 * 10 * (16 + 4) * 4
    assert cache.bytes_per_token == layer.cache_bytes_per_token() == (16 + 4) * 4
    mha = nn.MultiHeadAttention(64, 8)
    assert mha.new_cache(2, 10).bytes_per_token == 2 * 64 * 4


def test_full_cache_and_cached_backward_are_errors():
    layer = nn.LatentAttention(8, 2, 4, causal=True, rng=rng(12))
    cache = layer.new_cache(1, 2)
    layer.forward(np.ones((1, 2, 8)), cache=cache)
    with pytest.raises(qkv.ShapeError, match="KV cache is full"):
        layer.forward(np.ones((1, 1, 8)), cache=cache)
    with pytest.raises(RuntimeError, match="without cache"):
        layer.backward(np.ones((1, 2, 8)))
    with pytest.raises(qkv.ShapeError, match="needs a causal layer"):
        nn.LatentAttention(8, 2, 4).forward(np.ones((1, 1, 8)), cache=cache)
    with pytest.raises(qkv.ShapeError, match="d_rope must be even"):
        nn.LatentAttention(8, 2, 4, d_rope=3)
    with pytest.raises(qkv.ShapeError, match="rope_base must be a finite number > 1"):
        nn.LatentAttention(8, 2, 4, d_rope=2, rope_base=float("nan"))
    nn.LatentAttention(8, 2, 4, d_rope=0, rope_base=float("nan"))  # no RoPE part: the base is unused


def test_cache_table_numbers():
    rows = {r["variant"]: r for r in nn.cache_table(4096, 32, n_kv_heads=8, d_latent=512, d_rope=64)}
    assert [rows[v]["elements"] for v in ("MHA", "GQA", "MQA", "MLA")] == [8192, 2048, 256, 576]
    assert rows["MHA"]["bytes"] == 16384 and rows["MLA"]["vs_mha"] == pytest.approx(576 / 8192)
    # agrees with what the layers really allocate (float32 here)
    small = {r["variant"]: r for r in nn.cache_table(64, 8, n_kv_heads=2, d_latent=16, d_rope=4, dtype="float32")}
    assert small["GQA"]["bytes"] == nn.MultiHeadAttention(64, 8, n_kv_heads=2).cache_bytes_per_token()
    assert small["MQA"]["bytes"] == nn.MultiHeadAttention(64, 8, n_kv_heads=1).cache_bytes_per_token()
    assert small["MLA"]["bytes"] == nn.LatentAttention(64, 8, 16, d_rope=4).cache_bytes_per_token()
    with pytest.raises(qkv.ShapeError, match="multiple of n_kv_heads"):
        nn.cache_table(64, 8, n_kv_heads=3)


def test_cache_table_command(capsys):
    assert main(["cache-table", "--d-model", "5120", "--heads", "128", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "| MLA | latent 512 + rope key 64 | 576 | 1152 | 1.8 % |" in out
    assert main(["cache-table", "--heads", "7"]) == 2  # 4096 is not a multiple of 7
