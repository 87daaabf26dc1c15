"""Zoology's MQAR layers: BaseConv as a mixer, Based's Taylor linear attention, the state-size options,
and the GPT's head at the scored positions only."""
import numpy as np
import pytest

from qkv.models import GPT, GPTConfig
from qkv.nn import AdamW, BasedAttention, ConvMixer, gradient_errors


def taylor_features(a):
    """Based's TaylorExp written out: [1, x / f^(1/4), (x ⊗ x) / (√2 √f)]."""
    f = a.shape[-1]
    outer = (a[..., :, None] * a[..., None, :]).reshape(a.shape[:-1] + (f * f,))
    return np.concatenate([np.ones(a.shape[:-1] + (1,)), a / f ** 0.25, outer / np.sqrt(2 * f)], -1)


def test_based_is_linear_attention_over_the_taylor_features():
    rng = np.random.default_rng(0)
    layer = BasedAttention(8, 2, 4, dtype=np.float64, rng=rng)
    x = rng.standard_normal((2, 7, 8))
    heads = lambda w: (x @ layer.params[w]).reshape(2, 7, 2, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = taylor_features(heads("W_Q")), taylor_features(heads("W_K")), heads("W_V")
    state = np.cumsum(k[..., :, None] * v[..., None, :], axis=2)        # (B,H,T,F,D): the recurrent state
    norm = np.cumsum(k, axis=2)
    o = np.einsum("bhtf,bhtfd->bhtd", q, state) / np.einsum("bhtf,bhtf->bht", q, norm)[..., None]
    want = o.transpose(0, 2, 1, 3).reshape(2, 7, 8) @ layer.params["W_O"]
    np.testing.assert_allclose(layer.forward(x), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", [lambda rng: BasedAttention(8, 2, 4, dtype=np.float64, rng=rng),
                                  lambda rng: ConvMixer(8, 3, dtype=np.float64, rng=rng)])
def test_zoology_layers_gradients_match_finite_differences(make):
    rng = np.random.default_rng(1)
    errors = gradient_errors(make(rng), rng.standard_normal((2, 9, 8)))
    assert max(errors.values()) < 1e-6, errors


def tiny(layers, **kw):
    return GPTConfig(**{**dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, positions="rope",
                               layers=layers, dtype=np.float64), **kw})


@pytest.mark.parametrize("layers", ["baseconv,based", "baseconv,mamba2:expand=2", "baseconv,gated_delta:expand_v=2",
                                    "baseconv:kernel=2,attention"])
def test_zoology_models_train(layers):
    model = GPT(tiny(layers, dtype=np.float32))
    opt = AdamW(model, lr=1e-2)
    x = np.random.default_rng(0).integers(0, 40, (4, 16))
    losses = []
    for _ in range(15):
        losses.append(model.loss(x[:, :-1], x[:, 1:]))
        model.backward()
        opt.step()
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0]


def test_expand_doubles_the_recurrent_state():
    small, big = GPT(tiny("mamba2,gated_delta")), GPT(tiny("mamba2:expand=2,gated_delta:expand_v=2"))
    assert big.h[0].attn.d_inner == 2 * small.h[0].attn.d_inner
    assert big.h[1].attn.d_v == 2 * small.h[1].attn.d_v


def test_the_head_at_the_kept_positions_is_the_full_heads_rows_and_gradient():
    """loss with targets -1 elsewhere: the head's product at the kept rows only, the same loss and gradient."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 40, (3, 12))
    y = np.full((3, 12), -1)
    y[rng.random((3, 12)) < 0.3] = 5
    y[0, 3] = 7
    a, b = GPT(tiny("baseconv,attention")), GPT(tiny("baseconv,attention"))
    keep = y != -1
    np.testing.assert_allclose(a.logits_at(x, keep), a.forward(x)[keep], rtol=1e-12, atol=1e-14)
    la = a.loss(x, y)
    a.backward()
    logits = b.forward(x)                                              # the dense route, written out
    p = np.exp(logits[keep] - logits[keep].max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert la == pytest.approx(-np.mean(np.log(p[np.arange(keep.sum()), y[keep]])), rel=1e-12)
    eps, name = 1e-6, "transformer.wte.weight"
    w = b.params[name]
    for i, j in [(5, 0), (7, 3), (int(x[0, 0]), 1)]:                   # the head's rows and an input's row
        old = w[i, j]
        w[i, j] = old + eps
        up = b.loss(x, y)
        w[i, j] = old - eps
        down = b.loss(x, y)
        w[i, j] = old
        assert a.grads[name][i, j] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)
