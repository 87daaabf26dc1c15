"""qkv.nn: SelfAttention and MultiHeadAttention (gradients, cache, contract), Linear, Embedding, Adam."""
import numpy as np
import pytest

import qkv
from qkv import nn

from helpers import worst

TOL = 1e-6  # finite differences in float64 agree to ~1e-9; anything wrong is O(1)


def rng(seed=0):
    return np.random.default_rng(seed)


# --- SelfAttention ---------------------------------------------------------------------------

def test_self_attention_reproduces_the_texts_worked_example():
    layer = nn.SelfAttention(2, 2, dtype=np.float64)
    for name in ("W_Q", "W_K", "W_V"):
        layer.params[name][...] = np.eye(2)
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y, w = layer.forward(x, return_weights=True)
    np.testing.assert_allclose(w[0], [0.401, 0.198, 0.401], atol=5e-4)
    np.testing.assert_allclose(y, qkv.attention(x, x, x))


@pytest.mark.parametrize("shape,causal", [((5, 6), False), ((2, 3, 5, 6), True)])
def test_self_attention_gradients(shape, causal):
    x = rng(1).standard_normal(shape)
    layer = nn.SelfAttention(6, 4, d_v=3, causal=causal, dtype=np.float64, rng=rng(2))
    err, name = worst(nn.gradient_errors(layer, x))
    assert err < TOL, name
    assert set(layer.params) == set(layer.grads) == {"W_Q", "W_K", "W_V"}


def test_self_attention_checks_its_input():
    layer = nn.SelfAttention(6, 4, rng=rng())
    with pytest.raises(qkv.ShapeError, match=r"x must have shape \(\.\.\., T, d_model\) = \(\.\.\., T, 6\); got \(5, 4\)"):
        layer.forward(np.zeros((5, 4)))
    with pytest.raises(RuntimeError, match="forward call first"):
        nn.SelfAttention(6, 4).backward(np.zeros((5, 4)))
    with pytest.raises(qkv.ShapeError, match="causal must be"):
        nn.SelfAttention(6, 4, causal="upper")


def test_self_attention_computes_in_its_own_dtype():
    layer = nn.SelfAttention(6, 4, rng=rng(3))  # float32, fed float64 as MultiHeadAttention is
    y = layer.forward(rng(4).standard_normal((5, 6)))
    assert y.dtype == np.float32
    assert layer.backward(np.ones_like(y)).dtype == np.float32
    assert all(g.dtype == np.float32 for g in layer.grads.values())


# --- MultiHeadAttention: the parameter contract --------------------------------------------------

def test_mha_parameter_names_and_layouts():
    layer = nn.MultiHeadAttention(16, 4, n_kv_heads=2, bias=True, rng=rng())
    shapes = {k: v.shape for k, v in layer.params.items()}
    assert shapes == {"W_Q": (16, 16), "W_K": (16, 8), "W_V": (16, 8), "W_O": (16, 16),
                      "b_Q": (16,), "b_K": (8,), "b_V": (8,), "b_O": (16,)}
    assert all(v.dtype == np.float32 for v in layer.params.values())
    assert {k: v.shape for k, v in layer.grads.items()} == shapes
    wide = nn.MultiHeadAttention(16, 4, d_head=8, rng=rng())
    assert wide.params["W_Q"].shape == (16, 32) and wide.params["W_O"].shape == (32, 16)
    assert set(nn.MultiHeadAttention(16, 4).params) == {"W_Q", "W_K", "W_V", "W_O"}


def test_mha_equals_the_textbook_computation():
    """Projections x @ W + b, feature h*D + i is head h's feature i, softmax(q kᵀ/√D) v, W_O."""
    b, t, d, h = 2, 5, 12, 3
    x = rng(3).standard_normal((b, t, d))
    layer = nn.MultiHeadAttention(d, h, bias=True, dtype=np.float64, rng=rng(4))
    for k in ("b_Q", "b_K", "b_V", "b_O"):
        layer.params[k][...] = rng(5).standard_normal(layer.params[k].shape)
    p = layer.params
    q, k, v = (x @ p["W_" + n] + p["b_" + n] for n in "QKV")
    heads = []
    for i in range(h):
        sl = slice(4 * i, 4 * i + 4)
        s = q[..., sl] @ np.swapaxes(k[..., sl], -1, -2) / 2.0
        w = np.exp(s - s.max(-1, keepdims=True))
        heads.append((w / w.sum(-1, keepdims=True)) @ v[..., sl])
    expect = np.concatenate(heads, -1) @ p["W_O"] + p["b_O"]
    np.testing.assert_allclose(layer.forward(x), expect, atol=1e-12)


def test_mha_matches_torch_multihead_attention():
    torch = pytest.importorskip("torch")
    d, h, t = 8, 2, 5
    x = rng(6).standard_normal((2, t, d))
    layer = nn.MultiHeadAttention(d, h, bias=True, causal=True, dtype=np.float64, rng=rng(7))
    for k in ("b_Q", "b_K", "b_V", "b_O"):
        layer.params[k][...] = rng(8).standard_normal(layer.params[k].shape)
    p = layer.params
    ref = torch.nn.MultiheadAttention(d, h, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.from_numpy(np.concatenate([p["W_Q"].T, p["W_K"].T, p["W_V"].T])))
        ref.in_proj_bias.copy_(torch.from_numpy(np.concatenate([p["b_Q"], p["b_K"], p["b_V"]])))
        ref.out_proj.weight.copy_(torch.from_numpy(p["W_O"].T))
        ref.out_proj.bias.copy_(torch.from_numpy(p["b_O"]))
        xt = torch.from_numpy(x)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)  # torch: True = may NOT attend
        y, _ = ref(xt, xt, xt, attn_mask=mask, need_weights=False)
    np.testing.assert_allclose(layer.forward(x), y.numpy(), atol=1e-12)


# --- MultiHeadAttention: gradients for every option ----------------------------------------------

OPTIONS = {
    "mha": dict(),
    "bias": dict(bias=True),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "causal_window": dict(causal=True, window=2),
    "rope": dict(rope=True),
    "alibi": dict(alibi=True),
    "gqa_rope_alibi_causal_bias": dict(n_kv_heads=2, rope=True, alibi=True, causal=True, bias=True),
    "d_head": dict(d_head=6, n_kv_heads=2),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mha_self_attention_gradients(name):
    x = rng(10).standard_normal((2, 5, 8))
    layer = nn.MultiHeadAttention(8, 4, dtype=np.float64, rng=rng(11), **OPTIONS[name])
    err, which = worst(nn.gradient_errors(layer, x))
    assert err < TOL, which


@pytest.mark.parametrize("name", ["bias", "gqa_rope_alibi_causal_bias", "d_head"])
def test_fused_projections_equal_the_three_linears(monkeypatch, name):
    """From FUSE_ROWS rows on, self-attention's q, k, v come from one product against the
    three matrices side by side: the same output and the same gradients as three Linears."""
    from qkv.nn import attention_layer
    x = rng(15).standard_normal((2, 150, 8))
    dy = rng(16).standard_normal((2, 150, 8))
    runs, fused = {}, []
    real = attention_layer.AttentionLayer._fused_projections
    monkeypatch.setattr(attention_layer.AttentionLayer, "_fused_projections",
                        lambda self, x3: fused.append(1) or real(self, x3))
    for fuse in (True, False):
        monkeypatch.setattr(attention_layer, "FUSE_ROWS", 256 if fuse else 10**9)
        layer = nn.MultiHeadAttention(8, 4, dtype=np.float64, rng=rng(17), **OPTIONS[name])
        y = layer.forward(x)
        dx = layer.backward(dy)
        runs[fuse] = (y, dx, {k: g.copy() for k, g in layer.grads.items()})
    assert len(fused) == 1                                   # the 300 rows took the fused product once
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-12, atol=1e-13)
    for k in runs[False][2]:
        np.testing.assert_allclose(runs[True][2][k], runs[False][2][k], rtol=1e-12, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "rope", "alibi", "bias"])
def test_mha_cross_attention_gradients(name):
    x, c = rng(12).standard_normal((2, 4, 8)), rng(13).standard_normal((2, 7, 8))
    layer = nn.MultiHeadAttention(8, 4, dtype=np.float64, rng=rng(14), **OPTIONS[name])
    err, which = worst(nn.gradient_errors(layer, x, c))
    assert err < TOL, which
    dx, dc = layer.backward(np.ones((2, 4, 8)))
    assert dx.shape == (2, 4, 8) and dc.shape == (2, 7, 8)


@pytest.mark.parametrize("cross", [False, True])
def test_mha_kv_lengths_gradients_and_padding_is_ignored(cross):
    lengths = np.array([3, 6])
    x = rng(15).standard_normal((2, 6, 8))
    c = rng(16).standard_normal((2, 6, 8)) if cross else None
    inputs = (x, c) if cross else (x,)
    layer = nn.MultiHeadAttention(8, 2, n_kv_heads=1, dtype=np.float64, rng=rng(17))
    err, which = worst(nn.gradient_errors(layer, *inputs, kv_lengths=lengths))
    assert err < TOL, which
    src = c if cross else x
    junk = src.copy()
    junk[0, 3:] = 1e3  # padding of item 0 changes; keys there are never read
    y0 = layer.forward(x, c, kv_lengths=lengths) if cross else layer.forward(x, kv_lengths=lengths)
    if cross:
        y1 = layer.forward(x, junk, kv_lengths=lengths)
    else:
        y1 = layer.forward(np.concatenate([x[:, :3], junk[:, 3:]], 1), kv_lengths=lengths)
    np.testing.assert_allclose(y1[0, :3], y0[0, :3], atol=1e-12)


def test_mha_two_dimensional_input_and_weights():
    x = rng(18).standard_normal((5, 8))
    layer = nn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=rng(19))
    y, w = layer.forward(x, return_weights=True)
    assert y.shape == (5, 8) and w.shape == (2, 5, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0)
    assert np.all(np.triu(w[0], 1) == 0)
    np.testing.assert_allclose(y, layer.forward(x[None])[0])
    err, which = worst(nn.gradient_errors(layer, x))
    assert err < TOL, which


def test_mha_float32_layer_casts_inputs_and_runs():
    layer = nn.MultiHeadAttention(8, 2, rope=True, rng=rng(20))
    y = layer.forward(rng(21).standard_normal((2, 3, 8)))
    assert y.dtype == np.float32
    assert layer.backward(np.ones_like(y)).dtype == np.float32


def test_mha_bad_arguments_name_themselves():
    with pytest.raises(qkv.ShapeError, match="n_heads must be a multiple of n_kv_heads"):
        nn.MultiHeadAttention(8, 4, n_kv_heads=3)
    with pytest.raises(qkv.ShapeError, match="d_model must be a multiple of n_heads"):
        nn.MultiHeadAttention(10, 4)
    with pytest.raises(qkv.ShapeError, match="even d_head"):
        nn.MultiHeadAttention(6, 2, rope=True)
    with pytest.raises(qkv.ShapeError, match="causal"):
        nn.MultiHeadAttention(8, 2, causal="upper")
    with pytest.raises(qkv.ShapeError, match="rng"):
        nn.MultiHeadAttention(8, 2, rng=0)
    with pytest.raises(qkv.ShapeError, match=r"rope_base must be a finite number > 1 \(default 10000\); got 1\.0"):
        nn.MultiHeadAttention(8, 2, rope=True, rope_base=1.0)  # was accepted, then failed in forward as "base"
    layer = nn.MultiHeadAttention(8, 2)
    with pytest.raises(qkv.ShapeError, match=r"x must have shape \(B, T, d_model\) = \(\.\.\., 8\); got \(2, 3, 7\)"):
        layer.forward(np.zeros((2, 3, 7)))
    with pytest.raises(qkv.ShapeError, match="context must have x's batch"):
        layer.forward(np.zeros((2, 3, 8)), np.zeros((3, 4, 8)))
    with pytest.raises(qkv.ShapeError, match="kv_lengths"):
        layer.forward(np.zeros((2, 3, 8)), kv_lengths=np.array([1, 9]))
    layer.forward(np.zeros((2, 3, 8)))
    with pytest.raises(qkv.ShapeError, match="dy must have"):
        layer.backward(np.zeros((2, 4, 8)))


# --- KV cache --------------------------------------------------------------------------------------

CACHED = {
    "mha": dict(),
    "gqa_rope": dict(n_kv_heads=2, rope=True),
    "mqa_rope_bias": dict(n_kv_heads=1, rope=True, bias=True),
    "alibi_window": dict(n_kv_heads=2, alibi=True, window=3),
}


@pytest.mark.parametrize("name", list(CACHED))
def test_cache_prefill_then_one_token_at_a_time_equals_the_full_causal_pass(name):
    x = rng(30).standard_normal((2, 10, 8))
    layer = nn.MultiHeadAttention(8, 4, causal=True, dtype=np.float64, rng=rng(31), **CACHED[name])
    full = layer.forward(x)
    cache = layer.new_cache(2, 12)
    steps = [layer.forward(x[:, :4], cache=cache)]
    steps += [layer.forward(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    steps.append(layer.forward(x[:, 7:], cache=cache))  # a chunk of 3
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-12)
    assert cache.length == 10


def test_cache_float32_decoding_is_close_to_the_full_pass():
    x = rng(32).standard_normal((1, 6, 16)).astype(np.float32)
    layer = nn.MultiHeadAttention(16, 4, n_kv_heads=2, rope=True, causal=True, rng=rng(33))
    full = layer.forward(x)
    cache = layer.new_cache(1, 6)
    steps = [layer.forward(x[:, t:t + 1], cache=cache) for t in range(6)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_cache_nbytes_and_bytes_per_token():
    layer = nn.MultiHeadAttention(32, 8, n_kv_heads=2)
    cache = layer.new_cache(3, 100)
    assert cache.nbytes == 2 * 3 * 2 * 100 * 4 * 4  # k and v, B, Hkv, max_len, d_head, float32
    assert cache.bytes_per_token == layer.cache_bytes_per_token() == 2 * 2 * 4 * 4


def test_full_cache_is_an_error_and_leaves_the_cache_unchanged():
    layer = nn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=rng(34))
    cache = layer.new_cache(1, 4)
    layer.forward(rng(35).standard_normal((1, 3, 8)), cache=cache)
    before = cache["k"].copy()
    with pytest.raises(qkv.ShapeError, match=r"KV cache is full: it holds 3 of max_len = 4 tokens and cannot take 2 more"):
        layer.forward(np.ones((1, 2, 8)), cache=cache)
    assert cache.length == 3
    np.testing.assert_array_equal(cache["k"], before)
    layer.forward(np.ones((1, 1, 8)), cache=cache)
    with pytest.raises(qkv.ShapeError, match="full"):
        layer.forward(np.ones((1, 1, 8)), cache=cache)
    cache.reset()
    assert cache.length == 0


def test_cache_misuse_is_named():
    causal = nn.MultiHeadAttention(8, 2, causal=True)
    with pytest.raises(qkv.ShapeError, match="needs a causal layer"):
        nn.MultiHeadAttention(8, 2).forward(np.zeros((1, 2, 8)), cache=causal.new_cache(1, 4))
    with pytest.raises(qkv.ShapeError, match="batch size"):
        causal.forward(np.zeros((2, 2, 8)), cache=causal.new_cache(1, 4))
    with pytest.raises(qkv.ShapeError, match="context= and cache="):
        causal.forward(np.zeros((1, 2, 8)), np.zeros((1, 2, 8)), cache=causal.new_cache(1, 4))
    with pytest.raises(qkv.ShapeError, match="new_cache"):
        causal.forward(np.zeros((1, 2, 8)), cache=nn.LatentAttention(8, 2, 4).new_cache(1, 4))


@pytest.mark.parametrize("window", [None, 2])  # window 2: the step reads the last 3 keys only
def test_backward_after_a_cached_step_treats_the_cache_as_constant(window):
    x = rng(36).standard_normal((1, 5, 8))
    layer = nn.MultiHeadAttention(8, 2, n_kv_heads=1, rope=True, causal=True, window=window, dtype=np.float64,
                                  rng=rng(37))
    cache = layer.new_cache(1, 5)
    layer.forward(x[:, :4], cache=cache)
    k_prev, v_prev = cache.arrays["k"].copy(), cache.arrays["v"].copy()  # as stored (a window's: its ring)
    r = rng(38).standard_normal((1, 1, 8))
    layer.forward(x[:, 4:], cache=cache)
    dx = layer.backward(r)
    # the same step without the cache: attend from the new token to [fixed earlier keys; its own]
    eps = 1e-6
    for i in (0, 3, 7):
        vals = []
        for sgn in (1, -1):
            xp = x[:, 4:].copy()
            xp[0, 0, i] += sgn * eps
            c2 = layer.new_cache(1, 5)
            c2.arrays["k"][...], c2.arrays["v"][...] = k_prev, v_prev
            c2.advance(4)
            vals.append(np.sum(layer.forward(xp, cache=c2) * r))
        assert (vals[0] - vals[1]) / (2 * eps) == pytest.approx(dx[0, 0, i], abs=1e-8)


# --- Linear, Embedding, cross-entropy, Adam ------------------------------------------------------------

def test_linear_and_embedding_gradients():
    x = rng(40).standard_normal((3, 4, 5))
    err, which = worst(nn.gradient_errors(nn.Linear(5, 6, dtype=np.float64, rng=rng(41)), x))
    assert err < TOL, which
    emb = nn.Embedding(7, 3, dtype=np.float64, rng=rng(42))
    ids = np.array([[1, 2, 1], [6, 0, 1]])
    y = emb.forward(ids)
    np.testing.assert_array_equal(y[0, 0], emb.params["W"][1])
    emb.backward(np.ones_like(y))
    np.testing.assert_array_equal(emb.grads["W"][:, 0], [1, 3, 1, 0, 0, 0, 1])
    with pytest.raises(qkv.ShapeError, match=r"ids must lie in \[0, n\)"):
        emb.forward(np.array([7]))


def test_linear_and_embedding_name_a_misshapen_dy():
    lin = nn.Linear(4, 3, rng=rng(45))
    lin.forward(np.ones((2, 4)))
    with pytest.raises(qkv.ShapeError, match=r"dy must have the output's shape \(\.\.\., d_out\) = \(2, 3\); got \(2, 5\)"):
        lin.backward(np.ones((2, 5)))
    emb = nn.Embedding(5, 3, rng=rng(46))
    emb.forward(np.array([1, 2]))
    with pytest.raises(qkv.ShapeError, match=r"dy must have the output's shape \(\.\.\., d\) = \(2, 3\); got \(3, 3\)"):
        emb.backward(np.ones((3, 3)))


def test_cross_entropy_gradient_and_errors():
    logits = rng(43).standard_normal((4, 5))
    t = np.array([0, 4, 2, 2])
    loss, d = nn.cross_entropy(logits, t)
    eps = 1e-6
    for idx in [(0, 0), (1, 4), (3, 1)]:
        lp, lm = logits.copy(), logits.copy()
        lp[idx] += eps
        lm[idx] -= eps
        assert (nn.cross_entropy(lp, t)[0] - nn.cross_entropy(lm, t)[0]) / (2 * eps) == pytest.approx(d[idx], abs=1e-8)
    assert nn.cross_entropy(np.array([[1e4, 0.0]]), np.array([1]))[0] == pytest.approx(1e4)
    with pytest.raises(qkv.ShapeError, match="targets"):
        nn.cross_entropy(logits, np.array([0, 5, 1, 1]))
    with pytest.raises(qkv.ShapeError, match=r"at least one row and one class \(\.\.\., C\); got \(0, 5\)"):
        nn.cross_entropy(np.zeros((0, 5)), np.zeros(0, dtype=int))  # was nan and a RuntimeWarning


def test_adam_minimises_a_quadratic():
    layer = nn.Linear(3, 1, bias=False, dtype=np.float64, rng=rng(44))
    target = np.array([[1.0], [-2.0], [0.5]])
    opt = nn.Adam([layer], lr=0.05)
    for _ in range(400):
        layer.grads["W"][...] = 2 * (layer.params["W"] - target)
        opt.step()
    np.testing.assert_allclose(layer.params["W"], target, atol=1e-3)


def test_adam_of_arrays_says_it_wants_layers():
    with pytest.raises(qkv.ShapeError, match=r"layers must be qkv.nn layers .*layers\[1\] is ndarray"):
        nn.Adam([nn.Linear(3, 1, rng=rng(45)), np.zeros(3)])


def test_layers_at_a_size_where_auto_picks_the_tiled_kernel(monkeypatch):
    from qkv import api
    from qkv.kernels import flash

    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(flash, name)
        monkeypatch.setattr(flash, name, lambda *a, _real=real, _name=name, **kw:
                            calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **kw))
    # 4 heads x t x t score entries reach AUTO_FLASH_MIN: auto must pick the tiled kernel
    t = int(np.ceil(np.sqrt(api.AUTO_FLASH_MIN / 4))) + 3
    x = rng(50).standard_normal((1, t, 16))
    layer = nn.MultiHeadAttention(16, 4, n_kv_heads=2, rope=True, alibi=True, window=40, bias=True,
                                  causal=True, dtype=np.float64, rng=rng(51))
    err, which = worst(nn.gradient_errors(layer, x, n_checks=2))
    assert err < TOL, which
    full = layer.forward(x)
    cache = layer.new_cache(1, t)
    steps = [layer.forward(x[:, :t - 4], cache=cache)] + [layer.forward(x[:, i:i + 1], cache=cache)
                                                           for i in range(t - 4, t)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-12)
    assert calls["forward"] > 0 and calls["backward"] > 0, calls  # the tiled kernel really ran
