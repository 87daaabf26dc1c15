"""GatedDeltaNet's ``use_gate=False`` (fla's option, Zoology's MQAR setting): ``out = (norm_w ∘ rms(o)) W_out``,
no z columns; forward and backward in NumPy (finite differences, float64) and against qkv.torch's autograd."""
import math

import numpy as np
import pytest

from qkv.errors import OptionError
from qkv.nn import GatedDeltaNet, gradient_errors
from qkv.nn.recurrent_parts import rms_forward

DIMS = dict(d_model=6, n_k_heads=2, n_v_heads=2, d_k=3, d_v=4)


def layer(use_gate, seed=0, **kw):
    return GatedDeltaNet(**DIMS, conv_kernel=3, use_gate=use_gate, dtype=np.float64,
                         rng=np.random.default_rng(seed), **kw)


def test_no_gate_drops_the_z_columns_and_the_gate():
    gated, plain = layer(True), layer(False)
    Hv, Dv = DIMS["n_v_heads"], DIMS["d_v"]
    assert plain.params["W_in"].shape[1] == gated.params["W_in"].shape[1] - Hv * Dv
    x = np.random.default_rng(1).standard_normal((2, 5, DIMS["d_model"]))
    # the same recurrence: copy the gated layer's columns but z into the plain one
    widths = np.cumsum([0] + gated._widths)
    keep = np.r_[0:widths[3], widths[4]:widths[6]]
    for name in gated.params:
        plain.params[name][...] = gated.params[name][:, keep] if name == "W_in" else gated.params[name]
    gated.forward(x)
    flat_o = gated._saved["norm"][0]                              # rms(o) of the gated layer, (B, T, Hv, Dv)
    want = (gated.params["norm_weight"] * flat_o).reshape(2, 5, Hv * Dv) @ gated.params["W_out"]
    np.testing.assert_allclose(plain.forward(x), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("use_gate", [False, True])
def test_gradients_match_finite_differences(use_gate):
    rng = np.random.default_rng(2)
    errors = gradient_errors(layer(use_gate, allow_neg_eigval=not use_gate), rng.standard_normal((2, 7, 6)),
                             n_checks=12)
    assert max(errors.values()) < 1e-6, errors


def test_no_gate_prefill_then_steps_equal_the_whole_sequence():
    lay = layer(False, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 6, 6))
    whole = lay.forward(x)
    state = lay.new_state(2)
    parts = [lay.forward(x[:, :3], state=state)] + [lay.forward(x[:, t:t + 1], state=state) for t in range(3, 6)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=1e-12, atol=1e-13)


def test_use_gate_must_be_a_bool():
    with pytest.raises(OptionError, match="use_gate"):
        layer(1)


def test_rms_forward_is_the_norm_it_claims():
    h = np.random.default_rng(5).standard_normal((3, 4))
    hhat, r = rms_forward(h, 1e-5)
    np.testing.assert_allclose(hhat, h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5), rtol=1e-14)
    assert r.shape == (3, 1)


# --- qkv.torch --------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def torch_twin(np_layer, layout="olmo_hybrid"):
    """qkv.torch.GatedDeltaNet (fla's names) holding ``np_layer``'s weights, float64."""
    from qkv.torch import GatedDeltaNet as TorchGDN

    t = TorchGDN(**DIMS, conv_kernel=np_layer.conv_kernel, eps=np_layer.eps, layout=layout,
                 allow_neg_eigval=np_layer.allow_neg_eigval, use_gate=np_layer.use_gate, dtype=torch.float64)
    p = np_layer.params
    cols = dict(zip("qkvzba", np.split(p["W_in"], np.cumsum(np_layer._widths)[:-1], axis=1)))
    with torch.no_grad():
        for name, part in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("b_proj", "b"), ("a_proj", "a"),
                           ("g_proj", "z")):
            if hasattr(t, name):
                getattr(t, name).weight.copy_(torch.from_numpy(cols[part].T.copy()))
        t.conv1d.weight.copy_(torch.from_numpy(p["conv_weight"][:, None, :].copy()))
        t.dt_bias.copy_(torch.from_numpy(p["dt_bias"]))
        t.A_log.copy_(torch.from_numpy(p["A_log"]))
        t.o_norm.weight.copy_(torch.from_numpy(p["norm_weight"]))
        t.o_proj.weight.copy_(torch.from_numpy(p["W_out"].T.copy()))
    return t, cols


@pytest.mark.parametrize("use_gate", [False, True])
def test_numpy_forward_and_backward_equal_torch_autograd(use_gate):
    lay = layer(use_gate, seed=6)
    t, _ = torch_twin(lay)
    assert not use_gate == (not hasattr(t, "g_proj"))
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 6))
    y = lay.forward(x)
    dx = lay.backward(dy)
    xt = torch.from_numpy(x).requires_grad_(True)
    yt = t(xt)
    (yt * torch.from_numpy(dy)).sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-9, atol=1e-11)
    g = lay.grads
    parts = ["q", "k", "v"] + (["z"] if use_gate else []) + ["b", "a"]
    names = dict(q="q_proj", k="k_proj", v="v_proj", z="g_proj", b="b_proj", a="a_proj")
    dw_in = np.concatenate([getattr(t, names[p]).weight.grad.numpy().T for p in parts], axis=1)
    scale = lambda a: max(1.0, float(np.abs(a).max()))  # noqa: E731
    for ours, theirs in ((g["W_in"], dw_in), (g["W_out"], t.o_proj.weight.grad.numpy().T),
                         (g["conv_weight"], t.conv1d.weight.grad.numpy()[:, 0]), (g["A_log"], t.A_log.grad.numpy()),
                         (g["dt_bias"], t.dt_bias.grad.numpy()), (g["norm_weight"], t.o_norm.weight.grad.numpy())):
        assert np.abs(ours - theirs).max() <= 1e-9 * scale(theirs)


def test_torch_no_gate_needs_a_layout_with_z_apart():
    from qkv.torch import GatedDeltaNet as TorchGDN

    with pytest.raises(OptionError, match="use_gate.*layout"):
        TorchGDN(**DIMS, layout="qwen3_next", use_gate=False)
    with pytest.raises(OptionError, match="use_gate"):
        TorchGDN(**DIMS, layout="olmo_hybrid", use_gate="no")
    plain = TorchGDN(**DIMS, layout="qwen3_5", use_gate=False, dtype=torch.float64)
    assert not hasattr(plain, "in_proj_z") and "use_gate=False" in repr(plain)
    assert math.isfinite(float(plain(torch.randn(1, 4, 6, dtype=torch.float64)).detach().sum()))
