"""RG-LRU's bounded square-root derivative (transformers' ``SqrtBoundDerivative``, 1000) and
``sqrt_grad_bound=None``, the true derivative, in qkv.nn.RGLRU and qkv.torch.RGLRU: slow
channels (``Λ`` down to -22, so ``1 - a²`` down to ~1e-9, below the bound's 2.5e-7).
By default the gradients are transformers' (and miss finite differences by up to ~10x and
more); with None they are finite differences' (and torch autograd's of the plain formula)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference modules need torch")
pytest.importorskip("transformers", reason="the reference module is transformers'")

import recurrent_hf as R  # noqa: E402

import qkv  # noqa: E402
from qkv import nn  # noqa: E402
from qkv.nn.gradcheck import gradient_errors  # noqa: E402

LRU = 24


def _block():
    """transformers' block, float64, with slow channels where the bound holds."""
    module, _ = R.rglru(lru_width=LRU)
    with torch.no_grad():
        module.rg_lru.recurrent_param.copy_(torch.linspace(-22.0, 2.0, LRU))
    return module.double()


def _hf_run(module, x, r):
    """transformers' dx and parameter gradients (our names) of ``Σ y ∘ r``, in float64."""
    xt = R.tensor(x, grad=True)
    with R.float64():
        (R.full("rglru", module, xt) * R.tensor(r)).sum().backward()
    return R.numpy(xt.grad), R.hf_grads(nn.RGLRU, module)


def _inputs():
    rng = np.random.default_rng(4)
    return rng.standard_normal((2, 13, 16)), rng.standard_normal((2, 13, 16))


def _fd_lambda(layer, x, r, eps=1e-6):
    """Central differences of ``Σ y ∘ r`` in each ``Λ_j`` (relative steps)."""
    lam = layer.params["recurrent_param"]
    out = np.empty(lam.shape)
    for j in range(lam.size):
        keep, h = lam[j], eps * max(1.0, abs(lam[j]))
        lam[j] = keep + h
        up = np.sum(layer.forward(x) * r)
        lam[j] = keep - h
        down = np.sum(layer.forward(x) * r)
        lam[j] = keep
        out[j] = (up - down) / (2 * h)
    return out


@pytest.mark.parametrize("bound, lo, hi", [(1000.0, 0.5, np.inf), (None, 0.0, 1e-5)], ids=["bounded", "true"])
def test_lambda_gradient_against_finite_differences_entry_by_entry(bound, lo, hi):
    """Each ``Λ_j``'s gradient against its own central difference: the bound misses it by
    more than half (the slowest channel's is 1/14 of the true one); None matches it to the
    differences' own error (~3e-6)."""
    layer = nn.RGLRU.from_hf(_block(), dtype=np.float64, sqrt_grad_bound=bound)
    x, r = _inputs()
    layer.forward(x)
    layer.backward(r)
    got = layer.grads["recurrent_param"].copy()
    fd = _fd_lambda(layer, x, r)
    worst = float(np.max(np.abs(got - fd) / np.abs(fd)))
    assert lo < worst < hi, (worst, got, fd)


def test_default_is_transformers_gradient():
    module = _block()
    x, r = _inputs()
    dx_hf, want = _hf_run(module, x, r)
    layer = nn.RGLRU.from_hf(module, dtype=np.float64)
    layer.forward(x)
    assert R.rel(layer.backward(r), dx_hf) < 1e-10
    for name in layer.params:
        assert R.rel(layer.grads[name], want[name]) < 1e-10, name


@pytest.mark.parametrize("fused", [True, False], ids=["compiled-if-any", "numpy"])
def test_true_derivative_equals_finite_differences(fused, monkeypatch):
    if not fused:
        from qkv.nn import fusion
        monkeypatch.setattr(fusion, "module", lambda: None)
    layer = nn.RGLRU.from_hf(_block(), dtype=np.float64, sqrt_grad_bound=None)
    errors = gradient_errors(layer, _inputs()[0], n_checks=LRU)
    assert max(errors.values()) < 1e-6, errors


def test_true_derivative_changes_only_the_backward():
    module = _block()
    x, r = _inputs()
    bounded = nn.RGLRU.from_hf(module, dtype=np.float64)
    true = nn.RGLRU.from_hf(module, dtype=np.float64, sqrt_grad_bound=None)
    assert np.array_equal(bounded.forward(x), true.forward(x))
    bounded.backward(r)
    true.backward(r)
    ratio = np.abs(true.grads["recurrent_param"]) / np.abs(bounded.grads["recurrent_param"])
    assert ratio.max() > 10 and np.allclose(ratio[-LRU // 2:], 1, rtol=1e-12)   # fast channels: the same


def _torch_grads(layer, x, r):
    xt = torch.tensor(x, requires_grad=True)
    (layer(xt) * torch.tensor(r)).sum().backward()
    return xt.grad.numpy(), layer.rg_lru.recurrent_param.grad.numpy(), layer.rg_lru.recurrent_gate_weight.grad.numpy()


def test_torch_layer_default_and_true_derivative():
    """qkv.torch.RGLRU: transformers' gradients by default; with None, torch autograd of the
    plain formula, which equals qkv.nn's true derivative (checked against finite differences)."""
    from qkv.torch import RGLRU

    module = _block()
    x, r = _inputs()
    dx_hf, want = _hf_run(module, x, r)
    got = _torch_grads(RGLRU.from_hf(module), x, r)
    assert R.rel(got[0], dx_hf) < 1e-10 and R.rel(got[1], want["recurrent_param"]) < 1e-10
    numpy_true = nn.RGLRU.from_hf(module, dtype=np.float64, sqrt_grad_bound=None)
    numpy_true.forward(x)
    dx = numpy_true.backward(r)
    got = _torch_grads(RGLRU.from_hf(module, sqrt_grad_bound=None), x, r)
    assert R.rel(got[0], dx) < 1e-10
    assert R.rel(got[1], numpy_true.grads["recurrent_param"]) < 1e-10
    assert R.rel(got[2], numpy_true.grads["recurrent_gate_weight"]) < 1e-10


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "1000", True])
def test_a_bad_bound_is_refused(bad):
    with pytest.raises(qkv.ShapeError, match="sqrt_grad_bound must be None"):
        nn.RGLRU(8, 8, 2, sqrt_grad_bound=bad)
