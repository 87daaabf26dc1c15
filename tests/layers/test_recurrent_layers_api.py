"""qkv.nn.Mamba2, GatedDeltaNet and RGLRU as layers (no torch needed): finite-difference gradients,
backward after a stateful step, decoding state, dtypes, misuse named, training with Adam.
(Their parity with transformers' modules is tests/layers/test_recurrent_layers.py.)"""
import copy

import numpy as np
import pytest

import qkv
from qkv import nn


def rng(seed):
    return np.random.default_rng(seed)


def perturbed(layer, seed):
    """Every parameter moved off its init (no zeros and ones: A_log, D, norms, biases)."""
    g = rng(seed)
    for p in layer.params.values():
        p += (0.3 * g.standard_normal(p.shape)).astype(p.dtype)
    return layer


MAKERS = {
    "mamba2": lambda dtype=np.float64, seed=0: nn.Mamba2(12, 4, 3, 5, n_groups=2, conv_kernel=3, bias=True,
                                                          dtype=dtype, rng=rng(seed)),
    "mamba2_limit": lambda dtype=np.float64, seed=0: nn.Mamba2(8, 2, 4, 3, dt_limit=(0.01, 0.3), conv_kernel=2,
                                                                conv_bias=False, dtype=dtype, rng=rng(seed)),
    "gated_delta": lambda dtype=np.float64, seed=0: nn.GatedDeltaNet(10, 1, 2, 4, 3, conv_kernel=3, dtype=dtype,
                                                                      rng=rng(seed)),
    "gated_delta_neg_eigval": lambda dtype=np.float64, seed=0: nn.GatedDeltaNet(10, 2, 2, 3, 4, conv_kernel=2,
                                                                                 allow_neg_eigval=True, dtype=dtype,
                                                                                 rng=rng(seed)),
    "rglru": lambda dtype=np.float64, seed=0: nn.RGLRU(10, 8, 2, conv_width=3, dtype=dtype, rng=rng(seed)),
}
D_MODEL = {"mamba2": 12, "mamba2_limit": 8, "gated_delta": 10, "gated_delta_neg_eigval": 10, "rglru": 10}


@pytest.mark.parametrize("name", MAKERS)
def test_an_empty_sequence_gives_the_empty_result(name):
    """T = 0: the output is (B, 0, d_model) (2-D (0, d_model)), a state is left as it was, every
    parameter's gradient is zero and dx is empty (no step, as torch's empty autograd)."""
    layer = perturbed(MAKERS[name](), 6)
    d = D_MODEL[name]
    state = layer.new_state(2)
    layer.forward(rng(7).standard_normal((2, 5, d)), state=state)
    before = copy.deepcopy(state)
    for x, st in ((np.zeros((2, 0, d)), None), (np.zeros((2, 0, d)), state), (np.zeros((0, d)), None)):
        y = layer.forward(x, state=st)
        assert y.shape == x.shape and y.dtype == np.float64
        dx = layer.backward(np.zeros(x.shape))
        assert dx.shape == x.shape
        assert all(not g.any() for g in layer.grads.values())
    assert np.array_equal(state.conv, before.conv) and np.array_equal(state.recurrent, before.recurrent)
    assert state.length == before.length
    layer.forward(np.zeros((2, 0, d)))
    with pytest.raises(qkv.ShapeError, match=r"dy must have the output's shape \(2, 0, "):
        layer.backward(np.zeros((2, 1, d)))


@pytest.mark.parametrize("name", MAKERS)
def test_gradients_match_finite_differences(name):
    layer = perturbed(MAKERS[name](), 1)
    x = rng(2).standard_normal((2, 7, D_MODEL[name]))
    errors = nn.gradient_errors(layer, x, n_checks=4)
    assert set(errors) == set(layer.params) | {"input0"}
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("name", MAKERS)
def test_backward_after_a_stateful_step_treats_the_state_as_constant(name):
    layer = perturbed(MAKERS[name](seed=3), 4)
    x = rng(5).standard_normal((2, 6, D_MODEL[name]))
    state = layer.new_state(2)
    layer.forward(x[:, :4], state=state)

    class FromState:  # each forward starts from a copy of the same state
        params, grads = layer.params, layer.grads

        def forward(self, xx):
            return layer.forward(xx, state=copy.deepcopy(state))

        def backward(self, dy):
            return layer.backward(dy)

    errors = nn.gradient_errors(FromState(), np.ascontiguousarray(x[:, 4:]), n_checks=4)
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("name", MAKERS)
def test_token_by_token_decoding_equals_the_whole_sequence(name):
    layer = perturbed(MAKERS[name](seed=6), 7).eval()
    x = rng(8).standard_normal((3, 10, D_MODEL[name]))
    whole = layer.forward(x)
    state = layer.new_state(3)
    steps = np.concatenate([layer.forward(x[:, t:t + 1], state=state) for t in range(10)], axis=1)
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-10 * np.abs(whole).max())
    nbytes = state.nbytes
    layer.forward(x, state=state)
    assert state.nbytes == nbytes and state.length == 20   # constant size whatever the tokens seen
    state.reset()
    assert state.length == 0 and not state.recurrent.any() and not state.conv.any()


@pytest.mark.parametrize("name", MAKERS)
def test_float32_float16_and_two_dimensional_input(name):
    layer64 = perturbed(MAKERS[name](seed=9), 10)
    layer32 = MAKERS[name](np.float32, seed=9)
    for key in layer32.params:
        layer32.params[key][...] = layer64.params[key]
    x = rng(11).standard_normal((2, 9, D_MODEL[name]))
    y64, y32 = layer64.forward(x), layer32.forward(x.astype(np.float32))
    assert y32.dtype == np.float32
    assert np.abs(y32 - y64).max() < 1e-4 * np.abs(y64).max()
    y2 = layer64.forward(x[0])
    assert y2.shape == x[0].shape
    np.testing.assert_allclose(y2, y64[0], rtol=0, atol=1e-12)
    assert layer64.backward(np.ones_like(y2)).shape == x[0].shape
    half = MAKERS[name](np.float16, seed=9)
    y16 = half.forward(x)
    assert y16.dtype == np.float16 and np.isfinite(y16).all()
    assert half.new_state(1).recurrent.dtype == np.float32  # float16 computes in float32
    assert {g.dtype for g in half.grads.values()} == {np.dtype(np.float16)}


@pytest.mark.parametrize("name", MAKERS)
def test_eval_keeps_nothing_and_backward_says_so(name):
    layer = MAKERS[name]().eval()
    layer.forward(rng(12).standard_normal((1, 3, D_MODEL[name])))
    with pytest.raises(RuntimeError, match="eval"):
        layer.backward(np.zeros((1, 3, D_MODEL[name])))


def test_misuse_is_named():
    m = MAKERS["mamba2"]()
    with pytest.raises(qkv.ShapeError, match=r"x must have shape \(B, T, d_model\) = \(\.\.\., 12\)"):
        m.forward(np.zeros((2, 3, 11)))
    with pytest.raises(qkv.ShapeError, match=r"state.conv must have shape \(2, 2, 32\)"):
        m.forward(np.zeros((2, 3, 12)), state=m.new_state(3))
    with pytest.raises(qkv.ShapeError, match="state must come from this layer's new_state"):
        m.forward(np.zeros((2, 3, 12)), state=nn.LinearAttention(12, 2, causal=True).new_state(2))
    with pytest.raises(qkv.ShapeError, match="state.recurrent must have shape"):
        other = nn.Mamba2(12, 2, 6, 5, n_groups=2, conv_kernel=3, dtype=np.float64)  # same conv, other heads
        m.forward(np.zeros((2, 3, 12)), state=other.new_state(2))
    m.forward(np.zeros((2, 3, 12)))
    with pytest.raises(qkv.ShapeError, match=r"dy must have the output's shape \(2, 3, 12\)"):
        m.backward(np.zeros((2, 3, 11)))
    with pytest.raises(qkv.ShapeError, match="n_heads must be a multiple of n_groups"):
        nn.Mamba2(8, 3, 2, 4, n_groups=2)
    with pytest.raises(qkv.ShapeError, match="dt_limit"):
        nn.Mamba2(8, 2, 2, 4, dt_limit=(0.5, 0.1))
    with pytest.raises(qkv.ShapeError, match="n_v_heads must be a multiple of n_k_heads"):
        nn.GatedDeltaNet(8, 2, 3, 4, 4)
    with pytest.raises(qkv.OptionError, match="allow_neg_eigval must be True or False; got 'yes'"):
        nn.GatedDeltaNet(8, 2, 2, 4, 4, allow_neg_eigval="yes")
    with pytest.raises(qkv.ShapeError, match="lru_width must be a multiple of n_heads"):
        nn.RGLRU(8, 10, 3)
    with pytest.raises(qkv.ShapeError, match="conv_width must be"):
        nn.RGLRU(8, 8, 2, conv_width=0)
    with pytest.raises(qkv.ShapeError, match=r"x must have shape \(B, T, d_model\) = \(\.\.\., 10\)"):
        MAKERS["rglru"]().forward(np.zeros((1, 2, 8)))
    with pytest.raises(qkv.ShapeError, match=r"x must have shape \(B, T, d_model\) = \(\.\.\., 10\)"):
        MAKERS["gated_delta"]().forward(np.zeros((1, 2, 9)))


@pytest.mark.parametrize("name", ["mamba2", "gated_delta", "rglru"])
def test_trains_with_adam(name):
    """A few Adam steps on a regression target lower the loss: params and grads are wired up."""
    layer = MAKERS[name](np.float32, seed=13)
    x = rng(14).standard_normal((3, 6, D_MODEL[name])).astype(np.float32)
    target = np.roll(x, 1, axis=1)
    opt = nn.Adam([layer], lr=1e-2)
    losses = []
    for _ in range(25):
        y = layer.forward(x)
        losses.append(float(np.mean((y - target) ** 2)))
        layer.backward(2 * (y - target) / y.size)
        opt.step()
    assert losses[-1] < 0.8 * losses[0]


def _softplus(x):
    return np.logaddexp(0.0, x)


INIT_DECAY = {  # the share of the state a fresh layer keeps per step, at zero input (per head or channel)
    "mamba2": lambda l: np.exp(-np.exp(l.params["A_log"]) * _softplus(l.params["dt_bias"])),
    "gated_delta": lambda l: np.exp(-np.exp(l.params["A_log"]) * _softplus(l.params["dt_bias"])),
    "rglru": lambda l: np.exp(-8.0 * _softplus(l.params["recurrent_param"])),
}


@pytest.mark.parametrize("name", INIT_DECAY)
def test_fresh_layers_remember_past_tokens(name):
    """A freshly made layer keeps a useful share of its state per step (every head, several seeds):
    trained from scratch (MQAR, qkv experiment mqar), a layer that forgets the token before cannot
    learn to remember, as its decay's gradient vanishes with the decay. (transformers' Gated DeltaNet
    init, dt_bias = 1, keeps at most 0.27 per step and mostly < 1e-4.)"""
    make = {"mamba2": lambda s: nn.Mamba2(16, 8, 2, 4, rng=rng(s)),
            "gated_delta": lambda s: nn.GatedDeltaNet(16, 8, 8, 2, 2, rng=rng(s)),
            "rglru": lambda s: nn.RGLRU(16, 16, 8, rng=rng(s))}[name]
    for seed in range(5):
        kept = INIT_DECAY[name](make(seed))
        assert kept.min() > 0.1, (seed, kept)


def test_fresh_torch_gated_delta_remembers_past_tokens():
    """qkv.torch.GatedDeltaNet starts as qkv.nn's: every head keeps more than a tenth of its
    state a step (exp(-A · softplus(dt_bias)) at a zero input)."""
    torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch (the torch extra)")
    from qkv.torch import GatedDeltaNet

    for seed in range(5):
        torch.manual_seed(seed)
        layer = GatedDeltaNet(16, 8, 8, 2, 2)
        with torch.no_grad():
            kept = torch.exp(-torch.exp(layer.A_log) * torch.nn.functional.softplus(layer.dt_bias))
        assert float(kept.min()) > 0.1, (seed, kept)
