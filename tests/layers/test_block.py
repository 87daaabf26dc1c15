"""qkv.nn's transformer pieces: LayerNorm, RMSNorm, MLP (GELU, tanh GELU, SwiGLU), Dropout,
TransformerBlock around each attention layer, AdamW and cosine_lr.

Finite differences in float64 for every layer; PyTorch (where installed) for the numbers;
the numba passes (where installed) against the NumPy ones."""
import math

import numpy as np
import pytest

from qkv import ShapeError, jit, nn
from qkv.nn import activations, fusion

TOL = 1e-6  # finite differences in float64 agree to ~1e-9; anything wrong is O(1)
F64 = dict(dtype=np.float64)


def rng(seed=0):
    return np.random.default_rng(seed)


def jitter(layer, seed=3):
    """Move every parameter off its initial value (norm weights 1, biases 0) so that each
    enters the gradient check with a generic value."""
    r = rng(seed)
    for p in layer.params.values():
        p += 0.3 * r.standard_normal(p.shape)
    return layer


def worst(errors: dict) -> tuple:
    name = max(errors, key=errors.get)
    return errors[name], name


@pytest.fixture(params=["numpy", "fused"])
def path(request, monkeypatch):
    """Each test run on the NumPy passes and (where numba is installed) on the fused ones."""
    if request.param == "numpy":
        monkeypatch.setitem(jit._loaded, fusion.MODULE, None)
    elif fusion.module() is None:
        pytest.skip("numba is not installed (pip install -e '.[fast]') or QKV_JIT=0")
    return request.param


# --- gradients (finite differences) ----------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(7, **F64), lambda: nn.LayerNorm(7, bias=False, **F64),
                                  lambda: nn.RMSNorm(7, **F64)], ids=["layernorm", "layernorm-nobias", "rmsnorm"])
def test_norm_gradients(make, path):
    err, name = worst(nn.gradient_errors(jitter(make()), rng(1).standard_normal((2, 5, 7))))
    assert err < TOL, name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_gradients(activation, bias, path):
    layer = jitter(nn.MLP(6, 10, activation, bias, rng=rng(2), **F64))
    err, name = worst(nn.gradient_errors(layer, 2 * rng(1).standard_normal((2, 4, 6))))
    assert err < TOL, name
    want = {"W_fc", "W_proj"} | ({"W_gate"} if activation == "swiglu" else set())
    assert set(layer.params) == want | ({n.replace("W_", "b_") for n in want} if bias else set())


ATTENTIONS = {
    "mha-gqa-rope": lambda: nn.MultiHeadAttention(8, 4, n_kv_heads=2, causal=True, rope=True, bias=True,
                                                  rng=rng(4), **F64),
    "window": lambda: nn.MultiHeadAttention(8, 2, causal=True, window=2, rng=rng(4), **F64),
    "chunk": lambda: nn.MultiHeadAttention(8, 2, causal=True, chunk=3, rng=rng(4), **F64),
    "latent": lambda: nn.LatentAttention(8, 2, 4, d_rope=2, causal=True, rng=rng(4), **F64),
    "linear": lambda: nn.LinearAttention(8, 2, causal=True, rng=rng(4), **F64),
}


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_block_gradients_around_each_attention_layer(kind):
    block = jitter(nn.TransformerBlock(8, ATTENTIONS[kind](), activation="gelu_tanh", rng=rng(5), **F64))
    err, name = worst(nn.gradient_errors(block, rng(1).standard_normal((2, 6, 8))))
    assert err < TOL, name
    assert {"ln_1.weight", "ln_2.bias", "mlp.W_fc"} <= set(block.params)
    assert all(n in block.params for n in (f"attn.{k}" for k in block.attn.params))


def test_block_rmsnorm_swiglu_and_dropout_in_eval_mode():
    attn = nn.MultiHeadAttention(8, 2, causal=True, rng=rng(4), **F64)
    mlp = nn.MLP(8, 12, "swiglu", bias=False, rng=rng(6), **F64)
    block = jitter(nn.TransformerBlock(8, attn, mlp, norm="rmsnorm", dropout=0.5, rng=rng(5), **F64))
    x = rng(1).standard_normal((2, 6, 8))
    assert not np.array_equal(block.forward(x), block.forward(x))  # training: masks differ
    block.eval()
    assert block.drop_1.training is False and block.attn.training is False
    block.train()  # dropout of eval mode is the identity; a gradient check needs train() for backward:
    block.drop_1.p = block.drop_2.p = 0.0
    err, name = worst(nn.gradient_errors(block, x))
    assert err < TOL, name
    assert "ln_1.bias" not in block.params


def test_block_with_cache_equals_full_forward():
    """Prefill then one token at a time through the block's cache gives the uncached rows."""
    block = jitter(nn.TransformerBlock(8, ATTENTIONS["mha-gqa-rope"](), rng=rng(5), **F64)).eval()
    x = rng(1).standard_normal((2, 7, 8))
    full = block.forward(x)
    cache = block.new_cache(2, 7)
    rows = [block.forward(x[:, :4], cache=cache)] + [block.forward(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=0, atol=1e-12)
    lin = nn.TransformerBlock(8, ATTENTIONS["linear"](), rng=rng(5), **F64).eval()
    state = lin.new_cache(2, 7)
    steps = [lin.forward(x[:, t:t + 1], cache=state) for t in range(7)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), lin.forward(x), rtol=0, atol=1e-12)


def test_dropout():
    x = np.ones((200, 50))
    drop = nn.Dropout(0.25, rng(0), dtype=np.float64)
    y = drop.forward(x)
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.02 and np.allclose(y[kept], 1 / 0.75)
    np.testing.assert_array_equal(drop.backward(2 * x), 2 * y)  # the same mask
    assert drop.eval().forward(x) is x
    with pytest.raises(ShapeError, match="p must be"):
        nn.Dropout(1.0)


def test_bad_arguments_are_named():
    with pytest.raises(ShapeError, match="activation must be one of"):
        nn.MLP(4, activation="relu")
    with pytest.raises(ShapeError, match="norm must be one of"):
        nn.TransformerBlock(8, ATTENTIONS["window"](), norm="batchnorm")
    with pytest.raises(ShapeError, match="attn must have d_model = 4"):
        nn.TransformerBlock(4, ATTENTIONS["window"]())
    with pytest.raises(ShapeError, match=r"x must have shape \(..., d\) = \(..., 5\)"):
        nn.LayerNorm(5).forward(np.zeros((2, 4)))


# --- the numbers, against erf and PyTorch ------------------------------------------------------
def test_erf_is_float64_accurate():
    xs = np.concatenate([np.linspace(-7, 7, 2001), [0.0, 2.5, -2.5, 1e-300, 30.0]])
    want = np.array([math.erf(v) for v in xs])
    np.testing.assert_allclose(activations.erf(xs), want, rtol=2e-15, atol=1e-300)


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 4e-7), (np.float64, 1e-15)])
def test_sigmoid_is_relatively_accurate_everywhere_and_never_overflows(dtype, rtol):
    """σ to a few ulps of its own size, the far-negative tail (σ ~ e^a) included, where a
    form 1 - something would lose every digit; no overflow warning at ±100 (RuntimeWarning is
    an error in this suite)."""
    a = np.concatenate([np.linspace(-80, 80, 40001), [0.0, -0.0, 1e-30, -1e-30, -100.0, 100.0]]).astype(dtype)
    want = np.array([1 / (1 + math.exp(-float(v))) for v in a])
    got = activations.sigmoid(a)
    assert got.dtype == dtype
    keep = want > np.finfo(dtype).tiny * 1e3                    # σ a normal number of the dtype
    np.testing.assert_allclose(got[keep], want[keep], rtol=rtol, atol=0)
    y, (saved_a, saved_sig) = activations.silu_forward(a)
    np.testing.assert_allclose(y[keep], (a * want)[keep], rtol=2 * rtol, atol=0)



@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_sigmoid_numerator_is_the_selections_bits(dtype):
    """The numerator ``max(a >= 0, e^{-|a|})`` is exactly ``where(a >= 0, 1, e^{-|a|})``: the
    same bits everywhere, NaN, ±inf and ±0 included (a faster form of one selection)."""
    rng = np.random.default_rng(3)
    a = np.concatenate([rng.standard_normal(4099) * 30, [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40]])
    a = a.astype(dtype)
    e = np.exp(-np.abs(a))
    want = np.where(a >= 0, a.dtype.type(1), e) / (e + 1)
    got = activations.sigmoid(a)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(f"u{a.itemsize}"), want.view(f"u{a.itemsize}"))

@pytest.fixture
def _torch_one_thread():
    """torch on one thread for the comparisons (its pool only adds waiting on a busy 2-core machine)."""
    t = pytest.importorskip("torch", reason="the comparisons need PyTorch: pip install -e '.[torch]'")
    threads = t.get_num_threads()
    t.set_num_threads(1)
    yield
    t.set_num_threads(threads)


def _torch():
    return pytest.importorskip("torch", reason="the comparisons need PyTorch: pip install -e '.[torch]'")


def _compare(ours, theirs, x, dtype, tol):
    """Forward and input/parameter gradients of ``ours`` (qkv) and ``theirs`` (torch) on ``x``."""
    t = _torch()
    tx = t.tensor(x, requires_grad=True)
    ty = theirs(tx)
    y = ours.forward(x)
    dy = rng(9).standard_normal(y.shape).astype(dtype)
    ty.backward(t.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(ours.backward(dy), tx.grad.numpy(), rtol=tol, atol=tol)
    return ours


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_norms_match_torch(dtype, tol, path, _torch_one_thread):
    t = _torch()
    x = (3 * rng(1).standard_normal((3, 4, 16)) + 1).astype(dtype)
    for ours, theirs in ((nn.LayerNorm(16, dtype=dtype), t.nn.LayerNorm(16)),
                         (nn.RMSNorm(16, dtype=dtype), t.nn.RMSNorm(16, eps=1e-6))):
        theirs = theirs.to(t.float64 if dtype == np.float64 else t.float32)
        jitter(ours)
        with t.no_grad():
            for name, p in theirs.named_parameters():
                p.copy_(t.tensor(ours.params[name]))
        _compare(ours, theirs, x, dtype, tol)
        for name, p in theirs.named_parameters():
            np.testing.assert_allclose(ours.grads[name], p.grad.numpy(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swiglu"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_mlp_and_gelu_match_torch(activation, dtype, tol, path, _torch_one_thread):
    t = _torch()
    F = t.nn.functional
    mlp = nn.MLP(8, 24, activation, rng=rng(2), dtype=dtype)
    jitter(mlp)
    p = {k: t.tensor(v) for k, v in mlp.params.items()}

    def theirs(x):
        h = x @ p["W_fc"] + p["b_fc"]
        if activation == "swiglu":
            h = F.silu(x @ p["W_gate"] + p["b_gate"]) * h
        else:
            h = F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
        return h @ p["W_proj"] + p["b_proj"]

    x = (3 * rng(1).standard_normal((2, 5, 8))).astype(dtype)
    _compare(mlp, theirs, x, dtype, tol)


# --- AdamW and the schedule ------------------------------------------------------------------
class Toy(nn.Linear):
    no_decay = {"b"}


def _loss_grad(layer, x):
    y = layer.forward(x)
    layer.backward(2 * y)
    return float(np.sum(y * y))


def test_adamw_resumes_bit_for_bit(path):
    x = rng(1).standard_normal((6, 5))

    def run(steps, layer, opt):
        return [(_loss_grad(layer, x), opt.step(lr=0.01 * (s + 1))) for s in steps]

    a = nn.Linear(5, 3, rng=rng(2), **F64)
    b = nn.Linear(5, 3, rng=rng(2), **F64)
    opt_a, opt_b = nn.AdamW(a, lr=0.05, clip=0.5), nn.AdamW(b, lr=0.05, clip=0.5)
    whole = run(range(6), a, opt_a)
    first = run(range(3), b, opt_b)
    state, weights = opt_b.state_dict(), {k: v.copy() for k, v in b.params.items()}
    c = nn.Linear(5, 3, rng=rng(7), **F64)
    for k, v in weights.items():
        c.params[k][...] = v
    opt_c = nn.AdamW(c, lr=0.05, clip=0.5)
    opt_c.load_state_dict(state)
    assert int(state["step"]) == 3 and set(state) == {"step", "m/W", "m/b", "v/W", "v/b"}
    assert first + run(range(3, 6), c, opt_c) == whole
    with pytest.raises(ShapeError, match="keys"):
        opt_c.load_state_dict({"step": np.array(1)})


def test_adamw_decays_matrices_only_and_clips():
    layer = nn.Linear(4, 3, **F64)
    layer.grads["W"][...] = 0
    layer.grads["b"][...] = 0
    w, b = layer.params["W"].copy(), layer.params["b"].copy() + 1
    layer.params["b"][...] = b
    nn.AdamW(layer, lr=0.1, weight_decay=0.5).step()  # zero gradients: only the decay moves
    np.testing.assert_allclose(layer.params["W"], w * (1 - 0.1 * 0.5), rtol=1e-15)
    np.testing.assert_array_equal(layer.params["b"], b)
    toy = Toy(4, 3, **F64)
    opt = nn.AdamW(toy, weight_decay=0.5)
    assert [d for *_, d in opt.slots] == [True, False]  # "b" listed in no_decay; "W" a matrix
    toy.grads["W"][...] = 3.0
    toy.grads["b"][...] = 4.0
    norm = nn.AdamW(toy, clip=1.0).step()
    assert norm == pytest.approx(math.sqrt(12 * 9 + 3 * 16))


def test_cosine_lr_is_nanogpts_schedule():
    kw = dict(lr=1e-3, warmup=10, max_steps=100, min_lr=1e-4)
    assert nn.cosine_lr(0, **kw) == pytest.approx(1e-3 / 11)
    assert nn.cosine_lr(10, **kw) == pytest.approx(1e-3)
    assert nn.cosine_lr(55, **kw) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert nn.cosine_lr(100, **kw) == pytest.approx(1e-4) and nn.cosine_lr(500, **kw) == 1e-4
    lrs = [nn.cosine_lr(s, **kw) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_gelu_tanh_float32_element_by_element(path):
    """float32 GELU (tanh) on both paths against the float64 formula, over the whole range
    (the compiled one builds tanh from 2^x, and its backward computes it again from h):
    y within 4 ulps of max(|y|, |h|/2) each, dh within 8 ulps of the derivative's terms'
    size, and NaN and inf as NumPy's formula gives them."""
    from qkv.nn.activations import gelu_tanh_backward, gelu_tanh_forward

    h = np.concatenate([np.linspace(-20, 20, 40001), [0.0, 1e-30, -1e-30, 1e-4, -1e-4, 60.0, -60.0]]).astype(np.float32)
    y, saved = gelu_tanh_forward(h)
    h64 = h.astype(np.float64)
    t64 = np.tanh(np.sqrt(2 / np.pi) * (h64 + 0.044715 * h64 ** 3))
    y64 = 0.5 * h64 * (1 + t64)
    assert y.dtype == np.float32
    ulp = np.spacing(np.maximum(np.abs(y64), np.abs(h64) / 2).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(y - y64) <= 4 * ulp + 1e-45)
    dy = np.random.default_rng(0).standard_normal(h.shape).astype(np.float32)
    dh = gelu_tanh_backward(dy, saved)
    assert dh.dtype == np.float32
    slope = np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h64 ** 2)
    dh64 = dy * 0.5 * (1 + t64 + h64 * (1 - t64 ** 2) * slope)
    size = np.abs(dy) * 0.5 * (2 + np.abs(h64) * (1 + t64 ** 2) * slope)  # 1 - t² cancels: its terms are 1 + t²
    assert np.all(np.abs(dh - dh64) <= 8 * np.spacing(size.astype(np.float32)) + 1e-45)
    y, _ = gelu_tanh_forward(np.array([np.nan, np.inf], np.float32))


def test_gelu_float32_element_by_element(path):
    """float32 exact GELU on both paths against math.erfc in float64, over the whole range
    (the compiled one builds Φ from a fitted erfc and its own 2^x in float64): y and Φ within
    1 ulp (Φ relative to itself, so the far negative tail too, where 1 + erf cancels), dh
    within 2 ulps of its terms' size; 0 where Φ is below float32's least value; NaN and inf
    as the formula gives them."""
    import math

    from qkv.nn.activations import gelu_backward, gelu_forward

    rng = np.random.default_rng(3)
    h = np.concatenate([np.linspace(-16, 16, 64001), rng.standard_normal(20000) * 4,
                        [0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4, 60.0, -60.0, 3e38, -3e38]]).astype(np.float32)
    y, saved = gelu_forward(h)
    h64 = h.astype(np.float64)
    phi = np.array([0.5 * math.erfc(-x / math.sqrt(2.0)) for x in h64])
    y64 = h64 * phi
    assert y.dtype == np.float32 and saved[1].dtype == np.float32
    # the NumPy path forms 1 + erf(h/√2) with erf rounded to float32, which cancels in the
    # negative tail: Φ is exact there only to float32's absolute rounding (6e-8)
    tail = 0.0 if path == "fused" else 6e-8
    assert np.all(np.abs(y - y64) <= np.spacing(np.abs(y64).astype(np.float32)) + tail * np.abs(h64) + 1e-45)
    assert np.all(np.abs(saved[1] - phi) <= np.spacing(phi.astype(np.float32)) + tail + 1e-45)
    dy = rng.standard_normal(h.shape).astype(np.float32)
    dh = gelu_backward(dy, saved)
    pdf = h64 * np.exp(-0.5 * h64 * h64) / math.sqrt(2.0 * math.pi)
    dh64 = dy * (saved[1].astype(np.float64) + pdf)
    size = np.abs(dy) * (saved[1] + np.abs(pdf))
    assert dh.dtype == np.float32
    # the NumPy path's φ = exp(-h²/2) in float32 carries h²/2's rounding: h²/2 · eps of itself
    slack = 0.0 if path == "fused" else np.abs(dy * pdf) * (0.5 * h64 * h64 + 4) * 6e-8
    assert np.all(np.abs(dh - dh64) <= 2 * np.spacing(size.astype(np.float32)) + slack + 2e-38)  # (subnormals: either)
    with np.errstate(invalid="ignore"):                            # NumPy's -inf · 0 says so
        y, saved = gelu_forward(np.array([np.nan, np.inf, -np.inf], np.float32))
    assert np.isnan(y[0]) and y[1] == np.inf and np.isnan(y[2])   # -inf · Φ(-inf) = -inf · 0
    assert np.isnan(y[0]) and y[1] == np.inf


def test_layers_give_the_same_bits_for_any_thread_count(path):
    """LayerNorm's backward (fixed row chunks, their column sums added in order), the GELU's
    passes and AdamW's updates run on the kernel threads: the same bits for 1, 2 and 3."""
    from qkv.threads import kernel_threads

    x = (3 * rng(4).standard_normal((16, 260, 256))).astype(np.float32)   # past fusion.PARALLEL_MIN: threaded
    dy = rng(5).standard_normal(x.shape).astype(np.float32)
    runs = []
    for n in (1, 2, 3):
        with kernel_threads(n):
            ln, mlp = nn.LayerNorm(256, dtype=np.float32), nn.MLP(256, 2048, "gelu_tanh", rng=rng(6), dtype=np.float32)
            y = mlp.forward(ln.forward(x))
            dx = ln.backward(mlp.backward(dy))
            opt = nn.AdamW([ln, mlp], lr=1e-2)
            opt.step()
            runs.append([y, dx, ln.grads["weight"], *mlp.grads.values(), *mlp.params.values()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
