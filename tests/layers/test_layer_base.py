"""qkv.nn's shared layer machinery: flat params over Linear projections, train()/eval()."""
import tracemalloc

import numpy as np
import pytest

import qkv
from qkv import nn


def rng(seed=0):
    return np.random.default_rng(seed)


LAYERS = {
    "self": lambda: nn.SelfAttention(8, 4, causal=True, rng=rng(1)),
    "mha": lambda: nn.MultiHeadAttention(8, 2, n_kv_heads=1, bias=True, rope=True, causal=True, rng=rng(1)),
    "latent": lambda: nn.LatentAttention(8, 2, 4, causal=True, rng=rng(1)),
    "linear": lambda: nn.LinearAttention(8, 2, n_kv_heads=1, bias=True, causal=True, rng=rng(1)),
}


# --- params/grads: flat names over the Linear projections ------------------------------------------

def test_projections_are_linear_layers_shown_under_the_flat_names():
    layer = nn.MultiHeadAttention(8, 2, bias=True, rng=rng())
    assert all(isinstance(p, nn.Linear) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj))
    assert layer.params["W_Q"] is layer.q_proj.params["W"] and layer.params["b_O"] is layer.o_proj.params["b"]
    assert layer.grads["W_K"] is layer.k_proj.grads["W"]
    assert list(layer.params) == ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"]
    latent = nn.LatentAttention(8, 2, 4, rng=rng())
    assert latent.params["W_UK"] is latent.k_up.params["W"] and latent.params["W_KR"] is latent.k_rope.params["W"]
    assert nn.SelfAttention(4, 2).params["W_V"] is not None
    lin = nn.LinearAttention(8, 2, bias=True, rng=rng())
    assert lin.params["W_O"] is lin.o_proj.params["W"] and lin.grads["b_K"] is lin.k_proj.grads["b"]
    assert list(lin.params) == list(layer.params)


def test_assigning_a_param_reaches_the_projection_as_a_checkpoint_loader_does():
    """models.Bert puts the checkpoint's arrays in with ``layer.params[name] = array`` (no copy)."""
    layer = nn.MultiHeadAttention(4, 1, bias=True, dtype=np.float64, rng=rng())
    x = rng(2).standard_normal((1, 3, 4))
    for name, value in layer.params.items():
        layer.params[name] = np.eye(4) if name.startswith("W") else np.zeros(4)
    assert layer.q_proj.params["W"] is layer.params["W_Q"]
    w = np.exp(x @ x[0].T / 2.0)
    np.testing.assert_allclose(layer.forward(x), (w / w.sum(-1, keepdims=True)) @ x)
    with pytest.raises(KeyError, match="W_X"):
        layer.params["W_X"] = np.eye(4)
    with pytest.raises(TypeError):
        del layer.params["W_Q"]
    assert dict(layer.params).keys() == layer.grads.keys()


def test_adam_and_zero_grad_reach_the_projections():
    layer = nn.MultiHeadAttention(8, 2, dtype=np.float64, rng=rng(3))
    y = layer.forward(rng(4).standard_normal((2, 3, 8)))
    layer.backward(np.ones_like(y))
    before = layer.q_proj.params["W"].copy()
    nn.Adam([layer], lr=0.1).step()
    assert not np.allclose(layer.q_proj.params["W"], before)
    layer.zero_grad()
    assert not np.any(layer.o_proj.grads["W"])


def test_setting_dtype_reaches_the_projections():
    """A float32 layer turned float64 in place (as tests/cli/test_lookup.py does) computes in float64."""
    layer = nn.MultiHeadAttention(8, 2, rng=rng(8))
    for k in layer.params:
        layer.params[k] = layer.params[k].astype(np.float64)
        layer.grads[k] = np.zeros_like(layer.params[k])
    layer.dtype = np.dtype(np.float64)
    assert all(sub.dtype == np.float64 for sub in layer._sublayers)
    assert layer.forward(rng(9).standard_normal((1, 3, 8))).dtype == np.float64


# --- train() / eval() ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LAYERS))
def test_eval_forward_is_the_same_and_keeps_nothing(name):
    layer = LAYERS[name]()
    x = rng(5).standard_normal((2, 6, 8))
    y_train = layer.forward(x)
    assert layer.eval() is layer and not layer.training
    assert all(not sub.training for sub in layer._sublayers)
    np.testing.assert_array_equal(layer.forward(x), y_train)
    assert layer._saved is None and all(sub._saved is None for sub in layer._sublayers)
    with pytest.raises(RuntimeError, match=r"backward needs a forward in training mode: the last forward ran in "
                                           r"eval\(\) mode"):
        layer.backward(np.ones_like(y_train))
    assert layer.train() is layer and layer.training
    layer.forward(x)
    assert layer.backward(np.ones_like(y_train)).shape == x.shape


def test_latent_decoding_keeps_no_activations_even_in_training_mode():
    layer = nn.LatentAttention(8, 2, 4, causal=True, rng=rng(10))
    layer.forward(np.ones((1, 3, 8)), cache=layer.new_cache(1, 4))
    assert all(sub._saved is None for sub in layer._sublayers)
    with pytest.raises(RuntimeError, match="without cache"):  # the cached path is inference only
        layer.backward(np.ones((1, 3, 8)))


def test_eval_holds_less_memory_after_forward():
    """What a forward leaves allocated, less the kernels' own per-thread scratch (kept for reuse)."""
    x = rng(6).standard_normal((2, 256, 64)).astype(np.float32)

    def held(layer) -> int:
        tracemalloc.start(20)
        try:
            y = layer.forward(x)
            del y
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, "*/kernels/*", all_frames=True)])
            return sum(stat.size for stat in snap.statistics("filename"))
        finally:
            tracemalloc.stop()

    train = held(nn.MultiHeadAttention(64, 4, rng=rng(7)))
    infer = held(nn.MultiHeadAttention(64, 4, rng=rng(7)).eval())
    assert train > 4 * 2 * 256 * 64 * 4  # q, k, v and the merged heads: 128 KiB each
    assert infer < 32 * 1024  # nothing of the size of an activation


def test_linear_and_embedding_have_the_modes_too():
    lin = nn.Linear(3, 2, rng=rng()).eval()
    lin.forward(np.ones((4, 3)))
    with pytest.raises(RuntimeError, match="eval"):
        lin.backward(np.ones((4, 2)))
    emb = nn.Embedding(5, 2, rng=rng()).eval()
    emb.forward(np.array([1, 2]))
    assert emb._saved is None
    with pytest.raises(RuntimeError, match="forward call first"):
        nn.Embedding(5, 2).backward(np.ones((2, 2)))


def test_rope_base_checker_is_public():
    assert qkv.positional.check_base(500) == 500.0
    with pytest.raises(qkv.ShapeError, match=r"rope_base must be a finite number > 1"):
        qkv.positional.check_base(float("inf"), "rope_base")


@pytest.mark.parametrize("name", ["self", "mha", "latent", "mha64"])
def test_backward_on_the_forwards_checked_problem_equals_the_public_calls(name, monkeypatch):
    """The layers keep the forward's checked problem and kernel for their backward (no second
    round of checks): the same bits as qkv.attention_backward with the same options."""
    from qkv.nn.attention_layer import PREPARED, AttentionLayer

    make = (lambda: nn.MultiHeadAttention(8, 2, causal=True, dtype=np.float64, rng=rng(1))) if name == "mha64" \
        else LAYERS[name]
    x, dy = rng(2).standard_normal((3, 70, 8)), rng(3).standard_normal((3, 70, 8))
    seen, results = [], []
    public = AttentionLayer._attend_backward
    for prepared in (True, False):
        if not prepared:  # the same forward, its backward through qkv.attention_backward
            monkeypatch.setattr(AttentionLayer, "_attend_backward", staticmethod(
                lambda dout, q, k, v, out, lse, opts: public(dout, q, k, v, out, lse,
                                                             {n: o for n, o in opts.items() if n != PREPARED})))
        layer = make()
        y = layer.forward(x)
        s = layer._saved
        seen.append(PREPARED in (s["opts"] if isinstance(s, dict) else s[-1]))
        results.append([layer.backward(dy[..., :y.shape[-1]])] + [g.copy() for g in layer.grads.values()])
    assert seen == [True, True]
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("t, pooled, want", [(64, False, 1), (512, False, None), (64, True, None), (512, True, None)])
def test_a_layers_small_attention_stays_on_the_calling_thread(monkeypatch, t, pooled, want):
    """Below LAYER_SERIAL_WORK score entries a layer's attention forward and backward run with
    one kernel thread where the layer's projections ran on OpenBLAS's threads (they spin on
    after them); past it, or where the products run on numba's threads (qkv.nn.products), the
    caller's setting stands (None: the process default). A bare call is not held."""
    from qkv import api, threads
    from qkv.nn import attention_layer

    monkeypatch.setattr(attention_layer.products, "pooled", lambda: pooled)
    if pooled:   # a grain as OpenBLAS's Haswell kernels give one (none passes on some CPUs' kernels)
        monkeypatch.setattr(attention_layer.products, "grain", lambda: 12)

    seen = []
    real_fwd, real_bwd = api.Prepared.forward, api.Prepared.backward
    monkeypatch.setattr(api.Prepared, "forward", lambda *a, **kw: seen.append(threads._here.get()) or real_fwd(*a, **kw))
    monkeypatch.setattr(api.Prepared, "backward", lambda *a, **kw: seen.append(threads._here.get()) or real_bwd(*a, **kw))
    monkeypatch.setattr(attention_layer, "LAYER_SERIAL_WORK", 2 * 2 * 100 * 100)
    layer = nn.MultiHeadAttention(16, 2, causal=True, rng=rng(9))
    x = rng(10).standard_normal((2, t, 16)).astype(np.float32)
    y = layer.forward(x)
    layer.backward(np.ones_like(y))
    assert seen == [want, want]
    seen.clear()
    qkv.attention(x[:, None], x[:, None], x[:, None], causal=True)
    assert seen == [None]
