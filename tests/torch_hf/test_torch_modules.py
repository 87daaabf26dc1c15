"""qkv.torch.SelfAttention (the texts' module) and qkv.torch.MultiHeadAttention: state_dict
parity with the texts' class, conversion to and from the NumPy layers, the KV cache (its
ragged use is tests/torch_hf/test_torch_ragged_cache.py), errors that are the NumPy layers' own, training."""
import math

import numpy as np
import pytest

import qkv
from qkv import nn as qnn

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
qt = pytest.importorskip("qkv.torch")


class TextsSelfAttention(torch.nn.Module):
    """The texts' class, as printed there (attention by softmax)."""

    def __init__(self, d_model, d_k):
        super().__init__()
        self.W_Q = torch.nn.Linear(d_model, d_k, bias=False)
        self.W_K = torch.nn.Linear(d_model, d_k, bias=False)
        self.W_V = torch.nn.Linear(d_model, d_k, bias=False)

    def forward(self, x):
        Q, K, V = self.W_Q(x), self.W_K(x), self.W_V(x)
        scores = Q @ K.transpose(-2, -1) / math.sqrt(K.size(-1))
        weights = torch.nn.functional.softmax(scores, dim=-1)
        return weights @ V


def test_self_attention_state_dict_moves_between_the_texts_class_and_ours():
    torch.manual_seed(0)
    texts, ours = TextsSelfAttention(16, 8), qt.SelfAttention(16, 8)
    assert list(texts.state_dict()) == list(ours.state_dict()) == ["W_Q.weight", "W_K.weight", "W_V.weight"]
    ours.load_state_dict(texts.state_dict())
    x = torch.randn(3, 10, 16)
    torch.testing.assert_close(ours(x), texts(x), rtol=0, atol=1e-6)
    back = TextsSelfAttention(16, 8)
    back.load_state_dict(qt.SelfAttention(16, 8).state_dict())  # and the other way (strict)


def test_self_attention_gradients_equal_the_texts_class_in_float64():
    torch.manual_seed(1)
    texts = TextsSelfAttention(6, 4).double()
    ours = qt.SelfAttention(6, 4, dtype=torch.float64)
    ours.load_state_dict(texts.state_dict())
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    (texts(x) ** 2).sum().backward()
    (ours(x) ** 2).sum().backward()
    for name in ("W_Q", "W_K", "W_V"):
        a, b = getattr(ours, name).weight.grad, getattr(texts, name).weight.grad
        assert (a - b).abs().max().item() < 1e-12, name


def test_self_attention_converts_to_and_from_the_numpy_layer():
    rng = np.random.default_rng(0)
    layer = qnn.SelfAttention(6, 4, d_v=3, causal=True, dtype=np.float64, rng=rng)
    mod = qt.SelfAttention.from_numpy(layer)
    assert mod.W_V.weight.shape == (3, 6) and mod.causal is True
    x = rng.standard_normal((2, 5, 6))
    np.testing.assert_allclose(mod(torch.from_numpy(x)).detach().numpy(), layer.forward(x), atol=1e-13)
    back = mod.to_numpy()
    for name in ("W_Q", "W_K", "W_V"):
        np.testing.assert_array_equal(back.params[name], layer.params[name])


MHA_OPTIONS = {
    "gqa_causal_rope": dict(n_kv_heads=2, causal=True, rope=True),
    "mqa_window_alibi_bias": dict(n_kv_heads=1, window=(2, 1), alibi=True, bias=True),
    "mha_scale_rope_base": dict(scale=0.2, rope=True, rope_base=500.0, d_head=6),
    "bottom_right_chunk_window": dict(n_kv_heads=2, causal=True, align="bottom_right", chunk=3, window=4, alibi=True),
}


@pytest.mark.parametrize("case", sorted(MHA_OPTIONS))
def test_multihead_matches_the_numpy_layer_both_ways(case):
    rng = np.random.default_rng(2)
    layer = qnn.MultiHeadAttention(16, 4, dtype=np.float64, rng=rng, **MHA_OPTIONS[case])
    mod = qt.MultiHeadAttention.from_numpy(layer)
    x, ctx = rng.standard_normal((2, 7, 16)), rng.standard_normal((2, 9, 16))
    lengths = np.array([7, 4])
    y_np = layer.forward(x, kv_lengths=lengths)
    xt = torch.from_numpy(x).requires_grad_(True)
    y_t = mod(xt, kv_lengths=torch.from_numpy(lengths))
    np.testing.assert_allclose(y_t.detach().numpy(), y_np, atol=1e-12)
    dy = rng.standard_normal(y_np.shape)
    dx_np = layer.backward(dy)
    y_t.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(xt.grad.numpy(), dx_np, atol=1e-12)
    np.testing.assert_allclose(mod.q_proj.weight.grad.numpy().T, layer.grads["W_Q"], atol=1e-12)
    if not layer.causal:  # cross-attention
        np.testing.assert_allclose(mod(torch.from_numpy(x), torch.from_numpy(ctx)).detach().numpy(),
                                   layer.forward(x, ctx), atol=1e-12)
    back = mod.to_numpy()
    for name, value in layer.params.items():
        np.testing.assert_array_equal(back.params[name], value)
    np.testing.assert_allclose(back.forward(x, kv_lengths=lengths), y_np, atol=1e-12)


def test_multihead_kv_cache_decoding_equals_the_full_pass():
    torch.manual_seed(3)
    mod = qt.MultiHeadAttention(16, 4, n_kv_heads=2, causal=True, rope=True, alibi=True, window=4,
                                dtype=torch.float64)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        full = mod(x)
        cache = mod.new_cache(batch=2, max_len=9)
        steps = [mod(x[:, :5], cache=cache)] + [mod(x[:, t:t + 1], cache=cache) for t in range(5, 9)]
    assert cache.length == 9 and list(cache.lengths) == [9, 9]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    with pytest.raises(qkv.ShapeError, match="the KV cache is full"):
        mod(x[:, :1], cache=cache)
    assert list(cache.lengths) == [9, 9]
    # with grad on, this call's keys keep their graph and earlier ones are constants
    cache.reset()
    mod(x[:, :5].detach(), cache=cache)
    y = mod(x[:, 5:6], cache=cache)
    y.sum().backward()
    assert mod.k_proj.weight.grad is not None and torch.isfinite(mod.k_proj.weight.grad).all()


BAD_OPTIONS = {
    "kv heads": dict(n_kv_heads=3),
    "n_heads": dict(n_heads=0),
    "d_model not a multiple": dict(d_model=18),
    "d_head": dict(d_head=0),
    "odd d_head with rope": dict(d_head=5, rope=True),
    "rope_base": dict(rope=True, rope_base=1.0),
    "causal": dict(causal="sideways"),
    "align": dict(causal=True, align="middle"),
    "window": dict(window=(-1, 0)),
    "chunk": dict(chunk=0),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_multihead_constructor_errors_are_the_numpy_layers(case):
    kw = {"d_model": 16, "n_heads": 4, **BAD_OPTIONS[case]}
    with pytest.raises(qkv.ShapeError) as np_err:
        qnn.MultiHeadAttention(**kw)
    with pytest.raises(qkv.ShapeError) as t_err:
        qt.MultiHeadAttention(**kw)
    assert str(t_err.value) == str(np_err.value)
    # rope_base is checked only where RoPE is on, in both
    qt.MultiHeadAttention(16, 4, rope_base=1.0)


def _message(fn) -> str:
    with pytest.raises(qkv.ShapeError) as err:
        fn()
    return str(err.value)


BAD_CALLS = {  # x, context, keywords (arrays; the torch call gets tensors), the layer's options
    "x width": ((2, 3, 15), None, {}, {}),
    "x 4-D": ((1, 2, 3, 16), None, {}, {}),
    "x empty": ((2, 0, 16), None, {}, {}),
    "context batch": ((2, 3, 16), (3, 5, 16), {}, {}),
    "context 2-D beside 3-D x": ((2, 3, 16), (5, 16), {}, {}),
    "context width": ((2, 3, 16), (2, 5, 8), {}, {}),
    "cache without causal": ((2, 3, 16), None, {"cache": True}, {}),
    "cache with context": ((2, 3, 16), (2, 5, 16), {"cache": True}, dict(causal=True)),
    "kv_lengths": ((2, 3, 16), None, {"kv_lengths": np.array([3, 4])}, {}),
    "q_lengths": ((2, 3, 16), None, {"q_lengths": np.array([1.5, 2])}, {}),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_multihead_call_errors_are_the_numpy_layers(case):
    x_shape, c_shape, kw, options = BAD_CALLS[case]
    layer = qnn.MultiHeadAttention(16, 4, dtype=np.float64, rng=np.random.default_rng(0), **options)
    mod = qt.MultiHeadAttention.from_numpy(layer)
    x, ctx = np.zeros(x_shape), None if c_shape is None else np.zeros(c_shape)
    np_kw = {k: (layer.new_cache(2, 8) if k == "cache" else v) for k, v in kw.items()}
    t_kw = {k: (mod.new_cache(2, 8) if k == "cache" else torch.from_numpy(v)) for k, v in kw.items()}
    expected = _message(lambda: layer.forward(x, ctx, **np_kw))
    got = _message(lambda: mod(torch.from_numpy(x), None if ctx is None else torch.from_numpy(ctx), **t_kw))
    assert got == expected
    with pytest.raises(qkv.ShapeError, match=r"x must be a torch.Tensor of shape \(B, T, d_model\)"):
        mod(x)


def test_self_attention_errors_are_the_numpy_layers():
    layer = qnn.SelfAttention(6, 4)
    mod = qt.SelfAttention.from_numpy(layer)
    assert _message(lambda: mod(torch.zeros(2, 5, 7))) == _message(lambda: layer.forward(np.zeros((2, 5, 7))))
    for kw in (dict(causal="sideways"), dict(d_k=0), dict(d_v=-1)):
        args = {"d_model": 6, "d_k": 4, **kw}
        assert _message(lambda: qt.SelfAttention(**args)) == _message(lambda: qnn.SelfAttention(**args))


@pytest.mark.slow
def test_training_the_texts_module_with_a_torch_optimizer():
    # the README's example in small: the loss must fall
    torch.manual_seed(0)
    model = qt.SelfAttention(8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 6, 8)
    target = x.flip(1)  # each token must fetch the mirror token's vector
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
