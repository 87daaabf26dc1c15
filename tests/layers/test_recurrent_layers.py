"""qkv.nn.Mamba2, GatedDeltaNet and RGLRU against transformers' own modules (Mamba2Mixer,
Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet, OlmoHybridGatedDeltaNet,
RecurrentGemmaRecurrentBlock): outputs, input and parameter gradients, and cached decoding, in
float64 to 1e-10 and in float32 within a budget.

transformers runs these recurrences in float32 inside even a ``.double()`` module;
``recurrent_hf.float64()`` keeps its casts in float64 so its own code is the float64 reference.
The float32 budget: the qkv layer's error against that reference is at most twice the error
of transformers' float32 module (plain float32 math) on the same weights and inputs.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference modules need torch")
pytest.importorskip("transformers", reason="the reference modules are transformers'")

import recurrent_hf as R  # noqa: E402

from qkv import nn  # noqa: E402

LAYERS = {"mamba2": nn.Mamba2, "falcon_h1": nn.Mamba2, "gated_delta": nn.GatedDeltaNet, "rglru": nn.RGLRU,
          **{kind: nn.GatedDeltaNet for kind in R.GATED_DELTA_FAMILIES}}
CONFIGS = [  # (kind, config, B, T): head counts, groups, state sizes, Hk < Hv, conv widths, T = 37 and 1
    ("mamba2", dict(), 2, 37),
    ("mamba2", dict(groups=2, heads=4, state=6, conv=3, bias=True, seed=1), 1, 37),
    ("mamba2", dict(heads=2, head_dim=6, hidden=12, state=4, conv=2, conv_bias=False, limit=(0.05, 0.6), seed=2),
     2, 11),
    ("mamba2", dict(seed=3), 2, 1),
    # Falcon-H1's mixer: its norm after the gate (default), before it, or none; µP multipliers; biases apart
    ("falcon_h1", dict(), 2, 37),
    ("falcon_h1", dict(before_gate=False, groups=2, proj_bias=True, seed=1), 1, 19),
    ("falcon_h1", dict(rms_norm=False, out_bias=True, seed=2), 2, 11),
    ("gated_delta", dict(), 2, 37),
    ("gated_delta", dict(k_heads=2, v_heads=2, k_dim=6, v_dim=4, conv=3, seed=1), 1, 37),
    ("gated_delta", dict(k_heads=1, v_heads=3, conv=2, seed=2), 2, 11),
    ("gated_delta", dict(seed=3), 2, 1),
    # Qwen3.5's and Qwen3.5-MoE's layers (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and OLMo-Hybrid's
    # (q/k/v/a/b/g_proj, o_norm of eps 1e-5, beta = 2·sigmoid(b) with allow_neg_eigval, its default)
    ("qwen3_5", dict(), 2, 37),
    ("qwen3_5", dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=6,
                     linear_value_head_dim=4, linear_conv_kernel_dim=3, seed=1), 1, 37),
    ("qwen3_5_moe", dict(), 2, 37),
    ("olmo_hybrid", dict(), 2, 37),
    ("olmo_hybrid", dict(linear_allow_neg_eigval=False, linear_num_key_heads=1, linear_num_value_heads=3,
                         linear_conv_kernel_dim=2, seed=2), 2, 11),
    ("olmo_hybrid", dict(seed=3), 2, 1),
    ("rglru", dict(), 2, 37),
    ("rglru", dict(lru_width=16, heads=4, conv=2, seed=1), 1, 37),
    ("rglru", dict(lru_width=8, heads=1, conv=1, seed=2), 2, 11),
    ("rglru", dict(seed=3), 2, 1),
]
IDS = [f"{k}-{i}-T{t}" for i, (k, _, _, t) in enumerate(CONFIGS)]


def hidden(kind, cfg):
    if kind in R.GATED_DELTA_FAMILIES:
        return cfg.get("hidden_size", 32)   # tests/hf_hybrid.py's tiny configs
    return cfg.get("hidden", 16)


@pytest.mark.parametrize("kind, cfg, B, T", CONFIGS, ids=IDS)
def test_float64_output_and_every_gradient_equal_transformers(kind, cfg, B, T):
    module, _ = R.BUILD[kind](**cfg)
    module = module.double()
    layer = LAYERS[kind].from_hf(module, dtype=np.float64)
    rng = np.random.default_rng(T + 100 * cfg.get("seed", 0))
    x = rng.standard_normal((B, T, hidden(kind, cfg)))
    r = rng.standard_normal(x.shape)
    xt = R.tensor(x, grad=True)
    with R.float64():
        yt = R.full(kind, module, xt)
        (yt * R.tensor(r)).sum().backward()
    y = layer.forward(x)
    assert y.dtype == np.float64 and y.shape == x.shape
    assert R.rel(y, R.numpy(yt)) < 1e-10
    assert R.rel(layer.backward(r), R.numpy(xt.grad)) < 1e-10
    want = R.hf_grads(LAYERS[kind], module)
    # relative to the gradient's own size, or to the largest gradient where it is exactly 0
    # (A_log at T = 1 from a zero state: the chunked form's rounding leaves ~1e-17 there)
    scale = max(np.max(np.abs(g)) for g in want.values())
    errors = {name: float(np.max(np.abs(layer.grads[name] - want[name]))
                          / max(np.max(np.abs(want[name])), 1e-6 * scale)) for name in layer.params}
    assert max(errors.values()) < 1e-10, errors


FLOAT32 = [c for c in CONFIGS if c[1] == {}]


@pytest.mark.parametrize("kind, cfg, B, T", FLOAT32, ids=[c[0] for c in FLOAT32])
def test_float32_within_twice_transformers_float32_error(kind, cfg, B, T):
    module, _ = R.BUILD[kind](**cfg)
    layer32 = LAYERS[kind].from_hf(module, dtype=np.float32)
    x = np.random.default_rng(5).standard_normal((B, T, hidden(kind, cfg)))
    r = np.random.default_rng(6).standard_normal(x.shape)

    def hf(m, dtype, patch):
        xt = R.tensor(x.astype(dtype), grad=True)
        with (R.float64() if patch else _nothing()):
            yt = R.full(kind, m, xt)
            (yt * R.tensor(r.astype(dtype))).sum().backward()
        return R.numpy(yt), R.numpy(xt.grad)

    y64, dx64 = hf(module.double(), np.float64, True)
    y_hf, dx_hf = hf(module.float(), np.float32, False)
    y32 = layer32.forward(x.astype(np.float32))
    dx32 = layer32.backward(r.astype(np.float32))
    assert y32.dtype == dx32.dtype == np.float32
    assert R.rel(y32, y64) <= 2 * R.rel(y_hf, y64) + 1e-7
    assert R.rel(dx32, dx64) <= 2 * R.rel(dx_hf, dx64) + 1e-7


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


DECODE = [("mamba2", dict(groups=2), 5), ("mamba2", dict(conv=2, seed=4), 1), ("gated_delta", dict(), 5),
          ("gated_delta", dict(k_heads=1, v_heads=2, conv=3, seed=4), 2), ("rglru", dict(), 5),
          ("rglru", dict(conv=2, seed=4), 2), ("qwen3_5", dict(), 5), ("qwen3_5_moe", dict(seed=4), 1),
          ("olmo_hybrid", dict(), 5),
          ("olmo_hybrid", dict(linear_allow_neg_eigval=False, linear_num_key_heads=1, linear_conv_kernel_dim=3,
                               seed=4), 2)]


@pytest.mark.parametrize("kind, cfg, prefill", DECODE, ids=[f"{k}-{p}" for k, _, p in DECODE])
def test_prefill_then_steps_equal_the_whole_sequence_and_transformers_cached_decoding(kind, cfg, prefill):
    module, config = R.BUILD[kind](**cfg)
    module = module.double()
    layer = LAYERS[kind].from_hf(module, dtype=np.float64).eval()
    x = np.random.default_rng(7).standard_normal((2, 9, hidden(kind, cfg)))
    whole = layer.forward(x)
    state = layer.new_state(2)
    steps = [layer.forward(x[:, :prefill], state=state)]
    steps += [layer.forward(x[:, t:t + 1], state=state) for t in range(prefill, 9)]
    steps = np.concatenate(steps, axis=1)
    assert state.length == 9
    assert R.rel(steps, whole) < 1e-10
    with torch.no_grad(), R.float64():
        theirs = R.decode(kind, module, config, x, prefill)
    assert R.rel(steps, theirs) < 1e-10


def test_from_hf_refuses_what_it_cannot_place():
    module, _ = R.mamba2()
    with pytest.raises(nn_errors(), match="Mamba2.from_hf needs a transformers Mamba-2 mixer; got Qwen3NextGated"):
        nn.Mamba2.from_hf(R.gated_delta()[0])
    with pytest.raises(nn_errors(), match="RGLRU.from_hf needs a transformers RecurrentGemmaRecurrentBlock"):
        nn.RGLRU.from_hf(module)
    module.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(nn_errors(), match=r"Mamba2.from_hf: no place for the module's weights \['extra'\]"):
        nn.Mamba2.from_hf(module)
    gdn, _ = R.gated_delta()
    del gdn.norm.weight
    with pytest.raises(nn_errors(), match=r"GatedDeltaNet.from_hf: Qwen3NextGatedDeltaNet has the norm "
                                          r"Qwen3NextRMSNormGated \(qkv's is a gated RMSNorm\)"):
        nn.GatedDeltaNet.from_hf(gdn)
    block, _ = R.rglru()
    block.act_fn = torch.nn.ReLU()
    with pytest.raises(nn_errors(), match="activation must be tanh GELU"):
        nn.RGLRU.from_hf(block)


def nn_errors():
    import qkv
    return qkv.ShapeError


@pytest.mark.parametrize("kind, cfg, B, T", FLOAT32, ids=[c[0] for c in FLOAT32])
def test_float32_parameter_gradients_within_twice_transformers_float32_error(kind, cfg, B, T):
    """Every parameter gradient of the float32 layer (A_log and dt_bias are the decay's
    gradient: they erred 9-18x transformers' own float32 module while dlog_decay was summed as
    undecayed terms that cancel) against the float64 reference, relative to its largest entry,
    at most twice what transformers' float32 module errs on the same weights and inputs."""
    module, _ = R.BUILD[kind](**cfg)
    x = np.random.default_rng(7).standard_normal((B, T, hidden(kind, cfg)))
    r = np.random.default_rng(8).standard_normal(x.shape)

    def hf_param_grads(dtype, patch):
        m = module.double() if dtype == np.float64 else module.float()
        for p in m.parameters():
            p.grad = None
        with (R.float64() if patch else _nothing()):
            yt = R.full(kind, m, R.tensor(x.astype(dtype)))
            (yt * R.tensor(r.astype(dtype))).sum().backward()
        return R.hf_grads(LAYERS[kind], m)

    want = hf_param_grads(np.float64, True)
    theirs = hf_param_grads(np.float32, False)
    layer32 = LAYERS[kind].from_hf(module.float(), dtype=np.float32)
    layer32.forward(x.astype(np.float32))
    layer32.backward(r.astype(np.float32))
    for name in layer32.params:
        ours = R.rel(layer32.grads[name], want[name])
        assert layer32.grads[name].dtype == np.float32
        assert ours <= 2 * R.rel(theirs[name], want[name]) + 1e-6, (name, ours, R.rel(theirs[name], want[name]))


def test_from_hf_refuses_by_name_each_setting_it_does_not_compute():
    """A module is taken for what it computes: each setting qkv's layer does not compute is
    refused with the module's class and the setting (Falcon-H1's mixer was taken as a plain
    Mamba-2 one and gave errors of 0.6-1.6, or an AttributeError without its RMSNorm)."""
    falcon, _ = R.falcon_h1(groups=2)
    falcon.norm.n_groups = 1
    with pytest.raises(nn_errors(), match=r"Mamba2.from_hf: FalconH1Mixer normalises over groups .* \(1 groups\), "
                                          r"not its n_groups = 2"):
        nn.Mamba2.from_hf(falcon)
    falcon, _ = R.falcon_h1()
    falcon.activation = "relu"
    with pytest.raises(nn_errors(), match=r"FalconH1Mixer has the conv activation 'relu'"):
        nn.Mamba2.from_hf(falcon)
    falcon, _ = R.falcon_h1()
    falcon.mup_vector = torch.ones(5)
    with pytest.raises(nn_errors(), match=r"FalconH1Mixer.mup_vector must have the projection's width"):
        nn.Mamba2.from_hf(falcon)
    gdn, _ = R.gated_delta()
    gdn.norm.activation = "gelu"
    with pytest.raises(nn_errors(), match=r"Qwen3NextGatedDeltaNet gates its norm with 'gelu'"):
        nn.GatedDeltaNet.from_hf(gdn)
    with pytest.raises(nn_errors(), match=r"GatedDeltaNet.from_hf needs a transformers Gated DeltaNet layer; got "
                                          r"Mamba2Mixer \(no num_k_heads"):
        nn.GatedDeltaNet.from_hf(R.mamba2()[0])


def test_gated_delta_from_hf_refuses_by_name_each_setting_of_the_other_families():
    """Qwen3.5's and OLMo-Hybrid's layers are known by their weights; one with none of the three
    layouts, a bias qkv's layer does not hold, another conv activation or an allow_neg_eigval that
    is not a bool is refused with the class and the setting."""
    qwen, _ = R.gated_delta_family("qwen3_5")
    del qwen.in_proj_z
    with pytest.raises(nn_errors(), match=r"needs a transformers Gated DeltaNet layer \(Qwen3-Next's in_proj_qkvz, "
                                          r".*; got Qwen3_5GatedDeltaNet, which has none of these sets"):
        nn.GatedDeltaNet.from_hf(qwen)
    qwen, _ = R.gated_delta_family("qwen3_5")
    qwen.activation = "gelu"
    with pytest.raises(nn_errors(), match=r"Qwen3_5GatedDeltaNet has the conv activation 'gelu'"):
        nn.GatedDeltaNet.from_hf(qwen)
    olmo, _ = R.gated_delta_family("olmo_hybrid")
    olmo.q_proj.bias = torch.nn.Parameter(torch.zeros(olmo.q_proj.out_features))
    with pytest.raises(nn_errors(), match=r"GatedDeltaNet.from_hf: OlmoHybridGatedDeltaNet has a bias in q_proj, "
                                          r"which qkv's layer does not compute"):
        nn.GatedDeltaNet.from_hf(olmo)
    olmo, _ = R.gated_delta_family("olmo_hybrid")
    olmo.allow_neg_eigval = 2.0
    with pytest.raises(nn_errors(), match=r"OlmoHybridGatedDeltaNet has allow_neg_eigval = 2.0"):
        nn.GatedDeltaNet.from_hf(olmo)
    olmo, _ = R.gated_delta_family("olmo_hybrid")
    olmo.o_norm.activation = "gelu"
    with pytest.raises(nn_errors(), match=r"OlmoHybridGatedDeltaNet gates its norm with 'gelu'"):
        nn.GatedDeltaNet.from_hf(olmo)
