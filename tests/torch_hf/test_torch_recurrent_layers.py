"""qkv.torch.Mamba2, GatedDeltaNet and RGLRU against transformers' Mamba2Mixer,
Qwen3NextGatedDeltaNet (and Qwen3.5's, Qwen3.5-MoE's, OLMo-Hybrid's Gated DeltaNet) and
RecurrentGemmaRecurrentBlock: outputs, input and parameter
gradients, prefill-then-step decoding against the whole sequence and against transformers'
own cached decoding, float64 and float32.

transformers computes these layers' recurrences and norms in float32 whatever the module's
dtype (``.float()``, ``.to(torch.float32)``, ``acc_dtype=torch.float32``). The float64
reference is the same code with those casts made float64 (the fixture ``hf64``: the tests' one
float64 patch, ``recurrent_hf.float64()``), so that it can be held to 1e-10.
"""
import copy
import math

import pytest

import qkv

torch = pytest.importorskip("torch", reason="qkv.torch needs PyTorch: pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="the reference layers are transformers'")
qt = pytest.importorskip("qkv.torch")
from transformers import DynamicCache, Mamba2Config, Qwen3NextConfig, RecurrentGemmaConfig  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2 as m2  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as q3  # noqa: E402
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg  # noqa: E402

import recurrent_hf as R  # noqa: E402

DT = torch.float64


@pytest.fixture
def hf64():
    with R.float64():
        yield


def _perturb(module, seed):
    """Non-trivial values for every parameter transformers initialises to constants or leaves empty."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.rand(p.shape, generator=g, dtype=p.dtype)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.5 + 3 * r))
            elif name.endswith("dt_bias"):
                p.copy_(2 * r - 1.5)
            elif name.endswith(("D", "norm.weight")):
                p.copy_(0.5 + r)
            elif name.endswith("recurrent_param"):
                p.copy_(4 * r - 3)
            elif name.endswith("gate_weight"):
                p.copy_((2 * r - 1) * 1.7 / math.sqrt(p.shape[-1]))
            elif name.endswith("bias"):
                p.copy_(r - 0.5)
    return module


MAMBA = {  # hidden, heads, head_dim, state, groups, conv, biases
    "h4_g2": dict(hidden_size=8, num_heads=4, head_dim=4, state_size=3, n_groups=2, conv_kernel=4, expand=2),
    "h2_g1_bias": dict(hidden_size=12, num_heads=2, head_dim=6, state_size=5, n_groups=1, conv_kernel=3, expand=1,
                       use_bias=True),
    "h4_g4_noconvbias": dict(hidden_size=8, num_heads=4, head_dim=2, state_size=2, n_groups=4, conv_kernel=2,
                             expand=1, use_conv_bias=False),
}
DELTA = {
    "k2_v4": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=3,
                  linear_conv_kernel_dim=4),
    "k2_v2": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=3, linear_value_head_dim=5,
                  linear_conv_kernel_dim=2),
    "k1_v3": dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=4, linear_value_head_dim=2,
                  linear_conv_kernel_dim=3),
}
# Qwen3.5's, Qwen3.5-MoE's and OLMo-Hybrid's Gated DeltaNet (recurrent_hf.GATED_DELTA_FAMILIES): the same
# head layouts; OLMo-Hybrid with allow_neg_eigval (beta = 2·sigmoid(b), its default) and without
GDN_FAMILIES = {"qwen3_5": DELTA, "qwen3_5_moe": {"k2_v4": DELTA["k2_v4"]},
                "olmo_hybrid": {**DELTA, "k2_v4_beta1": dict(DELTA["k2_v4"], linear_allow_neg_eigval=False)}}
GRIFFIN = {
    "w6_h2": dict(hidden_size=8, lru_width=6, num_attention_heads=2, conv1d_width=4),
    "w8_h4": dict(hidden_size=8, lru_width=8, num_attention_heads=4, conv1d_width=2),
    "w4_h1_silu": dict(hidden_size=6, lru_width=4, num_attention_heads=1, conv1d_width=3, hidden_activation="silu"),
}
FALCON = {  # Falcon-H1's mixer: its norm after the gate (default), before it, or none; µP multipliers; biases
    "after_gate": dict(hidden=8, heads=4, head_dim=4, state=3, groups=2),
    "before_gate_in_bias": dict(hidden=8, heads=2, head_dim=4, state=3, before_gate=False, proj_bias=True, seed=1),
    "no_norm_out_bias": dict(hidden=8, heads=2, head_dim=4, state=3, conv=3, rms_norm=False, out_bias=True, seed=2),
}


def hf_layer(family, case, dtype=DT, seed=0):
    """``(transformers layer, its d_model, ours)``, weights shared."""
    torch.manual_seed(seed)
    if family == "mamba2":
        cfg = Mamba2Config(num_hidden_layers=1, chunk_size=16, **MAMBA[case])
        hf = m2.Mamba2Mixer(cfg, 0)
    elif family == "delta":
        cfg = Qwen3NextConfig(hidden_size=8, num_hidden_layers=1, layer_types=["linear_attention"], **DELTA[case])
        hf = q3.Qwen3NextGatedDeltaNet(cfg, 0)
    elif family == "falcon":
        hf, cfg = R.falcon_h1(**FALCON[case])
    elif family in GDN_FAMILIES:
        hf, cfg = R.gated_delta_family(family, seed=seed, hidden_size=8, **GDN_FAMILIES[family][case])
    else:
        cfg = RecurrentGemmaConfig(num_hidden_layers=1, **GRIFFIN[case])
        hf = rg.RecurrentGemmaRecurrentBlock(cfg, 0)
    hf = _perturb(hf, seed).to(dtype).eval()
    layers = {"mamba2": qt.Mamba2, "falcon": qt.Mamba2, "delta": qt.GatedDeltaNet, "griffin": qt.RGLRU,
              **{f: qt.GatedDeltaNet for f in GDN_FAMILIES}}
    ours = layers[family].from_hf(hf)
    return hf, cfg, ours


def hf_call(family, hf, cfg, x, decode_from=None):
    """transformers' output for x: whole (no cache), or prefill x[:, :decode_from] then one token at a time."""
    if family == "griffin":
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        if decode_from is None:
            return hf(x, pos, None, use_cache=False)[0]
        steps = [(0, decode_from)] + [(t, t + 1) for t in range(decode_from, x.shape[1])]
        return torch.cat([hf(x[:, a:b], pos[:, a:b], None, use_cache=True)[0] for a, b in steps], dim=1)
    if decode_from is None:
        return hf(x)
    cache = DynamicCache(config=cfg)
    steps = [(0, decode_from)] + [(t, t + 1) for t in range(decode_from, x.shape[1])]
    return torch.cat([hf(x[:, a:b], cache=cache) for a, b in steps], dim=1)


def ours_decoding(layer, x, decode_from):
    y, state = layer(x[:, :decode_from], return_state=True)
    ys = [y]
    for t in range(decode_from, x.shape[1]):
        y, state = layer(x[:, t:t + 1], state, return_state=True)
        ys.append(y)
    return torch.cat(ys, dim=1)


CASES = [(f, c) for f, table in (("mamba2", MAMBA), ("delta", DELTA), ("griffin", GRIFFIN), *GDN_FAMILIES.items())
         for c in table]
GDN_ONE = [("qwen3_5", "k2_v4"), ("qwen3_5_moe", "k2_v4"), ("olmo_hybrid", "k2_v4")]   # one case of each class


def _inputs(cfg, t, dtype=DT):
    d = cfg.hidden_size
    return torch.randn(2, t, d, generator=torch.Generator().manual_seed(t), dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("family, case", CASES + [("falcon", c) for c in FALCON])
def test_float64_outputs_and_gradients_equal_transformers(hf64, family, case):
    hf, cfg, ours = hf_layer(family, case)
    for t in (1, 19):
        x = _inputs(cfg, t)
        results = []
        for layer, fn in ((hf, lambda x: hf_call(family, hf, cfg, x)), (ours, ours)):
            layer.zero_grad()
            xg = x.clone().requires_grad_()
            y = fn(xg)
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
            (y * w).sum().backward()
            results.append((y.detach(), xg.grad, {n: p.grad for n, p in layer.named_parameters()}))
        (y_hf, dx_hf, dp_hf), (y_us, dx_us, dp_us) = results
        assert (y_us - y_hf).abs().max() <= 1e-10 * max(1.0, y_hf.abs().max()), t
        assert (dx_us - dx_hf).abs().max() <= 1e-10 * max(1.0, dx_hf.abs().max()), t
        assert dp_us.keys() == dp_hf.keys()
        for name in dp_hf:
            ref = dp_hf[name]
            assert (dp_us[name] - ref).abs().max() <= 1e-10 * max(1.0, ref.abs().max()), (t, name)


@pytest.mark.slow
@pytest.mark.parametrize("family, case", CASES)
def test_float64_decoding_equals_the_whole_sequence_and_transformers_cache(hf64, family, case):
    hf, cfg, ours = hf_layer(family, case)
    x = _inputs(cfg, 9)
    with torch.no_grad():
        whole = ours(x)
        for start in (1, 5):
            stepped = ours_decoding(ours, x, start)
            assert (stepped - whole).abs().max() <= 1e-12, start
            if family == "griffin" and start == 1 and cfg.hidden_size != cfg.lru_width:
                continue  # transformers' block sizes a fresh conv cache by hidden_size: one token fails there
            theirs = hf_call(family, hf, cfg, x, decode_from=start)
            assert (stepped - theirs).abs().max() <= 1e-10, start


@pytest.mark.parametrize("family, case", [("mamba2", "h4_g2"), ("delta", "k2_v4"), ("griffin", "w6_h2"),
                                          ("olmo_hybrid", "k2_v4")])
def test_gradients_flow_through_the_state_between_calls(family, case):
    """Training through prefill-then-step (the state carries the gradient) gives the whole
    sequence's gradients: the final state's gradient reaches the initial state's operator."""
    _, cfg, layer = hf_layer(family, case)
    x = _inputs(cfg, 6)
    w = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(3), dtype=DT)
    grads = []
    for split in (None, 3):
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        y = layer(xg) if split is None else ours_decoding(layer, xg, split)
        (y * w).sum().backward()
        grads.append([xg.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, b.abs().max())


def test_float64_sequence_past_a_chunk(hf64):
    # T = 70: transformers' chunked forms (16 and 64) pad their last chunk
    for family, case in (("mamba2", "h4_g2"), ("delta", "k2_v4"), ("griffin", "w6_h2"), *GDN_ONE):
        hf, cfg, ours = hf_layer(family, case)
        x = _inputs(cfg, 70)[:1]
        with torch.no_grad():
            assert (ours(x) - hf_call(family, hf, cfg, x)).abs().max() <= 1e-10, family


@pytest.mark.parametrize("family, case", [("mamba2", "h4_g2"), ("delta", "k2_v4"), ("griffin", "w6_h2"), *GDN_ONE])
def test_float32_within_twice_transformers_own_error(family, case, monkeypatch, request):
    """Budget: qkv's float32 layer errs against the float64 reference at most twice what
    transformers' float32 layer errs (plus 1e-7 · the output's scale), outputs and input
    gradients alike."""
    hf32, cfg, ours32 = hf_layer(family, case, dtype=torch.float32)
    hf64 = copy.deepcopy(hf32).to(DT)   # the same weights (built under hf64, an init would draw other numbers)
    x = _inputs(cfg, 19, dtype=torch.float32)

    def run(layer, fn, x):
        xg = x.clone().requires_grad_()
        y = fn(xg)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        return y.detach().double(), xg.grad.double()

    theirs = run(hf32, lambda x: hf_call(family, hf32, cfg, x), x)
    ours = run(ours32, ours32, x)
    request.getfixturevalue("hf64")
    ref = run(hf64, lambda x: hf_call(family, hf64, cfg, x), x.double())
    for a, b, r in zip(ours, theirs, ref):
        budget = 2 * (b - r).abs().max() + 1e-7 * r.abs().max()
        assert (a - r).abs().max() <= budget


def test_from_hf_checks_every_weight():
    hf, cfg, ours = hf_layer("delta", "k2_v4")
    hf.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(qkv.ShapeError, match="not taken \\['extra'\\]"):
        qt.GatedDeltaNet.from_hf(hf)
    with pytest.raises(qkv.ShapeError, match="needs a transformers Mamba-2 mixer; got Qwen3NextGatedDeltaNet"):
        qt.Mamba2.from_hf(hf)
    from qkv.torch.layer_state import load_hf
    small = qt.GatedDeltaNet(8, 2, 4, 4, 2)
    del hf.extra
    with pytest.raises(qkv.ShapeError, match="weight .* must have shape"):
        load_hf(small, hf, "Qwen3NextGatedDeltaNet")


def test_from_hf_refuses_by_name_what_it_does_not_compute():
    """The same reading of a module as qkv.nn's (qkv.nn.hf_variants): a setting qkv's layer does
    not compute is refused with the module's class and the setting; a Mamba-2 mixer of another
    class that computes the same is taken."""
    falcon, _ = R.falcon_h1(groups=2)
    falcon.norm.n_groups = 1
    with pytest.raises(qkv.ShapeError, match=r"qkv.torch.Mamba2.from_hf: FalconH1Mixer normalises over groups"):
        qt.Mamba2.from_hf(falcon)
    hf, _, _ = hf_layer("griffin", "w6_h2")
    with pytest.raises(qkv.ShapeError, match=r"RGLRU.from_hf needs a transformers RecurrentGemmaRecurrentBlock; "
                                             r"got Mamba2Mixer"):
        qt.RGLRU.from_hf(hf_layer("mamba2", "h4_g2")[0])
    gdn, _, _ = hf_layer("delta", "k2_v4")
    gdn.norm.activation = "gelu"
    with pytest.raises(qkv.ShapeError, match=r"Qwen3NextGatedDeltaNet gates its norm with 'gelu'"):
        qt.GatedDeltaNet.from_hf(gdn)
    from transformers.models.bamba.configuration_bamba import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer
    cfg = BambaConfig(hidden_size=8, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4, mamba_expand=2,
                      num_hidden_layers=1, vocab_size=11, num_attention_heads=2, num_key_value_heads=1)
    bamba = _perturb(BambaMixer(cfg, layer_idx=0), 3).to(DT).eval()
    x = _inputs(cfg, 7)
    with torch.no_grad():
        assert (qt.Mamba2.from_hf(bamba)(x) - bamba(x)).abs().max() <= 1e-5 * bamba(x).abs().max()


def test_gated_delta_from_hf_refuses_by_name_each_setting_of_the_other_families():
    """Qwen3.5's and OLMo-Hybrid's layers are read as qkv.nn reads them: a layer with none of the
    three weight layouts, a bias, or an allow_neg_eigval that is not a bool is refused with the
    class and the setting; the layout and allow_neg_eigval options are checked where they are given."""
    qwen, _, _ = hf_layer("qwen3_5", "k2_v4")
    del qwen.in_proj_b
    with pytest.raises(qkv.ShapeError, match=r"qkv.torch.GatedDeltaNet.from_hf needs a transformers Gated DeltaNet "
                                             r"layer \(.*OLMo-Hybrid's q_proj.*\); got Qwen3_5GatedDeltaNet"):
        qt.GatedDeltaNet.from_hf(qwen)
    olmo, _, _ = hf_layer("olmo_hybrid", "k2_v4")
    olmo.g_proj.bias = torch.nn.Parameter(torch.zeros(olmo.g_proj.out_features, dtype=DT))
    with pytest.raises(qkv.ShapeError, match=r"OlmoHybridGatedDeltaNet has a bias in g_proj, which qkv's layer"):
        qt.GatedDeltaNet.from_hf(olmo)
    olmo, _, _ = hf_layer("olmo_hybrid", "k2_v4")
    olmo.allow_neg_eigval = "yes"
    with pytest.raises(qkv.ShapeError, match=r"OlmoHybridGatedDeltaNet has allow_neg_eigval = 'yes'"):
        qt.GatedDeltaNet.from_hf(olmo)
    with pytest.raises(qkv.OptionError, match=r"layout must be one of \('qwen3_next', 'qwen3_5', 'olmo_hybrid'\); "
                                              r"got 'olmo'"):
        qt.GatedDeltaNet(8, 1, 2, 3, 2, layout="olmo")
    with pytest.raises(qkv.OptionError, match="allow_neg_eigval must be True or False; got 1"):
        qt.GatedDeltaNet(8, 1, 2, 3, 2, allow_neg_eigval=1)


@pytest.mark.parametrize("layout", ["qwen3_5", "olmo_hybrid"])
def test_gated_delta_layouts_hold_transformers_names_and_compute_one_function(layout):
    """A layer made with a layout has that transformers layer's parameter names; the same weights
    under each layout (and Qwen3-Next's interleaving) give the same output."""
    hf, cfg, ours = hf_layer(layout, "k2_v4")
    assert ours.state_dict().keys() == hf.state_dict().keys()
    assert ours.layout == layout and ours.allow_neg_eigval == (layout == "olmo_hybrid")
    qwen3_next = qt.GatedDeltaNet(8, 2, 4, 4, 3, eps=ours.eps, allow_neg_eigval=ours.allow_neg_eigval, dtype=DT)
    w = dict(ours.named_parameters())
    W = {"qwen3_5": lambda: (w["in_proj_qkv.weight"], w["in_proj_z.weight"], w["in_proj_b.weight"],
                             w["in_proj_a.weight"]),
         "olmo_hybrid": lambda: (w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"], w["g_proj.weight"],
                                 w["b_proj.weight"], w["a_proj.weight"])}[layout]()
    q, k, v, z, b, a = torch.cat(W).split([8, 8, 12, 12, 4, 4])            # rows [q | k | v | z | b | a]
    per_key_head = [t.reshape(2, -1, 8) for t in (q, k, v, z)]              # Hk = 2, r = 2
    with torch.no_grad():
        qwen3_next.in_proj_qkvz.weight.copy_(torch.cat(per_key_head, dim=1).reshape(-1, 8))
        qwen3_next.in_proj_ba.weight.copy_(torch.cat([b.reshape(2, 2, 8), a.reshape(2, 2, 8)], 1).reshape(-1, 8))
        for name in ("conv1d.weight", "dt_bias", "A_log"):
            qwen3_next.get_parameter(name).copy_(w[name])
        norm, out = ("o_norm", "o_proj") if layout == "olmo_hybrid" else ("norm", "out_proj")
        qwen3_next.norm.weight.copy_(w[f"{norm}.weight"])
        qwen3_next.out_proj.weight.copy_(w[f"{out}.weight"])
        x = _inputs(cfg, 6)
        assert (qwen3_next(x) - ours(x)).abs().max() <= 1e-12 * ours(x).abs().max()


@pytest.mark.parametrize("layer", [qt.Mamba2(8, 2, 4, state_size=3), qt.GatedDeltaNet(8, 1, 2, 3, 2),
                                   qt.RGLRU(8, 4, 2)], ids=["mamba2", "delta", "griffin"])
def test_bad_inputs_and_states_raise(layer):
    with pytest.raises(qkv.ShapeError, match="must be a tensor of shape \\(B, T, d_model\\) with d_model = 8"):
        layer(torch.zeros(2, 3, 7))
    _, state = layer(torch.zeros(2, 3, 8), return_state=True)
    with pytest.raises(qkv.ShapeError, match="state.conv must have shape"):
        layer(torch.zeros(3, 1, 8), state)
    with pytest.raises(qkv.ShapeError, match="state must be a qkv.torch.RecurrentState"):
        layer(torch.zeros(2, 1, 8), state.recurrent)


@pytest.mark.parametrize("make", [lambda: qt.Mamba2(8, 2, 4, state_size=3, n_groups=2, dtype=DT),
                                  lambda: qt.GatedDeltaNet(8, 1, 2, 3, 2, dtype=DT),
                                  lambda: qt.RGLRU(8, 4, 2, dtype=DT)], ids=["mamba2", "delta", "griffin"])
def test_an_empty_sequence_gives_the_empty_result(make):
    """T = 0 (it raised a bare reshape or conv1d error): y is (B, 0, d_model), the state comes
    back unchanged, every parameter's gradient is zero and the state's gradient passes through."""
    layer = _perturb(make(), 1)
    _, state = layer(torch.randn(2, 4, 8, dtype=DT), return_state=True)
    conv0, rec0 = (t.detach().clone().requires_grad_() for t in (state.conv, state.recurrent))
    x = torch.zeros(2, 0, 8, dtype=DT, requires_grad=True)
    y, new = layer(x, qt.RecurrentState(conv0, rec0), return_state=True)
    assert y.shape == (2, 0, 8)
    assert torch.equal(new.conv, conv0) and torch.equal(new.recurrent, rec0)
    dconv, drec = torch.randn_like(conv0), torch.randn_like(rec0)
    (y.sum() + (new.conv * dconv).sum() + (new.recurrent * drec).sum()).backward()
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())
    assert torch.equal(conv0.grad, dconv) and torch.equal(rec0.grad, drec)
    assert layer(torch.zeros(2, 0, 8, dtype=DT)).shape == (2, 0, 8)   # a fresh sequence


def test_compiled_module_equals_eager():
    layer = _perturb(qt.GatedDeltaNet(8, 1, 2, 3, 2), 0)
    x = torch.randn(2, 5, 8)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-6, atol=1e-6)
