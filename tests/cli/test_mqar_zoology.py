"""``qkv experiment mqar``'s Zoology model (:func:`qkv.experiments.mqar.zoology_model`) against a torch twin:
the same network built from qkv.torch layers (and torch ops where qkv.torch has no module), trained by torch
autograd and torch.optim.AdamW from qkv's initial weights, on the same batches, in float64."""
import math

import numpy as np
import pytest

from qkv.experiments.mqar import HYBRIDS, MIXERS, MQARConfig, zoology_mixers, zoology_model
from qkv.experiments.mqar_data import mqar_batch
from qkv.nn import gradient_errors  # noqa: F401  (the layers' own checks live beside them)

torch = pytest.importorskip("torch")
F = torch.nn.functional

CFG = MQARConfig(vocab_size=96, pairs=(4,), seq_len=32, batch=6, steps=50, widths=(32,), lrs=(3e-3,),
                 embed_dropout=0.0, attention_dropout=0.0)
SLOW = {"rglru", "attention+rglru", "attention+mamba2", "attention+based", "attention+linear", "linear"}


def T(a):
    return torch.tensor(np.asarray(a), dtype=torch.float64)


def conv(u, w, b):
    """qkv's causal depthwise conv (taps ``w (C, K)``, the last one on the current token) in torch."""
    K = w.shape[1]
    return F.conv1d(u.transpose(1, 2), w[:, None, :], b, padding=K - 1, groups=w.shape[0])[..., :u.shape[1]].transpose(1, 2)


class Fn(torch.nn.Module):
    """A mixer written with torch ops: its parameters under qkv's names, ``fn(params, x)``."""

    def __init__(self, params, fn):
        super().__init__()
        self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(T(v)) for k, v in params.items()})
        self.fn = fn

    def forward(self, x):
        return self.fn(self.p, x)


def baseconv(p, u):
    return conv(u, p["conv_weight"], p["conv_bias"]) * (u @ p["W_proj"] + p["b_proj"]) + u


def based(p, u, f=16):
    q, k, v = u @ p["W_Q"], u @ p["W_K"], u @ p["W_V"]              # one head
    s = q @ k.transpose(1, 2) / math.sqrt(f)
    w = torch.tril(1 + s + s * s / 2)
    return (w @ v) / (w.sum(-1, keepdim=True) + 1e-12) @ p["W_O"]


def linear(p, u, heads=CFG.n_head):
    B, L, C = u.shape
    split = lambda t: t.reshape(B, L, heads, C // heads).transpose(1, 2)  # noqa: E731
    q, k, v = (split(u @ p[f"W_{n}"] + p[f"b_{n}"]) for n in "QKV")
    q, k = F.elu(q) + 1, F.elu(k) + 1
    w = torch.tril(q @ k.transpose(-1, -2))
    o = ((w @ v) / w.sum(-1, keepdim=True)).transpose(1, 2).reshape(B, L, C)
    return o @ p["W_O"] + p["b_O"]


def load(module, table, params):
    with torch.no_grad():
        for name, (ours, how) in table.items():
            module.get_parameter(name).copy_(T(how(params[ours])))


def torch_mixer(kind, layer):
    import qkv.torch as qt

    p, tr, same, taps = layer.params, np.transpose, (lambda a: a), (lambda w: w[:, None, :])
    if kind == "baseconv":
        return Fn(p, baseconv)
    if kind == "based":
        return Fn(p, based)
    if kind == "linear":
        return Fn(p, linear)
    if kind == "attention":
        m = qt.MultiHeadAttention(layer.d_model, 1, causal=True, bias=True, dtype=torch.float64)
        load(m, {f"{n.lower()}_proj.{w}": (f"{'W' if w == 'weight' else 'b'}_{n}", tr if w == "weight" else same)
                 for n in "QKVO" for w in ("weight", "bias")}, p)
        return m
    if kind == "gated_delta":
        m = qt.GatedDeltaNet(layer.d_model, 2, 2, layer.d_k, layer.d_v, conv_kernel=4, eps=layer.eps,
                             layout="olmo_hybrid", use_gate=False, dtype=torch.float64)
        cols = dict(zip("qkvzba", np.split(p["W_in"], np.cumsum(layer._widths)[:-1], axis=1)))
        with torch.no_grad():
            for n in "qkvba":
                getattr(m, f"{n}_proj").weight.copy_(T(cols[n].T))
        load(m, {"conv1d.weight": ("conv_weight", taps), "dt_bias": ("dt_bias", same), "A_log": ("A_log", same),
                 "o_norm.weight": ("norm_weight", same), "o_proj.weight": ("W_out", tr)}, p)
        return m
    if kind == "mamba2":
        m = qt.Mamba2(layer.d_model, layer.n_heads, layer.head_dim, state_size=layer.state_size, conv_kernel=4,
                      conv_bias=True, bias=False, eps=layer.eps, dtype=torch.float64)
        load(m, {"in_proj.weight": ("W_in", tr), "conv1d.weight": ("conv_weight", taps), "conv1d.bias": ("conv_bias", same),
                 "dt_bias": ("dt_bias", same), "A_log": ("A_log", same), "D": ("D", same),
                 "norm.weight": ("norm_weight", same), "out_proj.weight": ("W_out", tr)}, p)
        return m
    m = qt.RGLRU(layer.d_model, layer.lru_width, layer.n_heads, conv_width=4, dtype=torch.float64)
    table = {f"linear_{n}.{w}": (f"{'W' if w == 'weight' else 'b'}_{n}", tr if w == "weight" else same)
             for n in ("x", "y", "out") for w in ("weight", "bias")}
    table.update({"conv_1d.weight": ("conv_weight", taps), "conv_1d.bias": ("conv_bias", same)})
    table.update({f"rg_lru.{n}": (n, same) for n in ("recurrent_param", "input_gate_weight", "input_gate_bias",
                                                      "recurrent_gate_weight", "recurrent_gate_bias")})
    load(m, table, p)
    return m


class Twin(torch.nn.Module):
    """Zoology's LanguageModel (TransformerBlock with the Identity state mixer, or Mamba2Block) in torch."""

    def __init__(self, model, kinds, block):
        super().__init__()
        self.block = block
        self.wte = torch.nn.Parameter(T(model.wte.params["W"]))
        self.mixers = torch.nn.ModuleList(torch_mixer(k, m) for k, m in zip(kinds, model.mixers))

        def norm(ours):
            n = (torch.nn.LayerNorm if "bias" in ours.params else torch.nn.RMSNorm)(model.d_model, eps=ours.eps,
                                                                                       dtype=torch.float64)
            load(n, {k: (k, lambda a: a) for k in ours.params}, ours.params)
            return n
        self.norm1 = torch.nn.ModuleList(norm(n) for n in model.norm1)
        self.norm2 = torch.nn.ModuleList(norm(n) for n in model.norm2)
        self.ln_f = norm(model.ln_f)

    def loss(self, idx, targets):
        r = self.wte[torch.as_tensor(idx)]
        for i, mixer in enumerate(self.mixers):
            r = r + mixer(self.norm1[i](r))
            if len(self.norm2):
                r = r + self.norm2[i](r)
        keep = torch.as_tensor(targets != -1)
        logits = self.ln_f(r)[keep] @ self.wte.T
        return F.cross_entropy(logits, torch.as_tensor(targets[targets != -1]))


def train_both(mixer, steps):
    from qkv.training.loop import lr_at, make_optimizer

    cfg = MQARConfig(**{**CFG.__dict__, "steps": steps})
    ours = zoology_model(cfg, mixer, 32, 0, dtype=np.float64)
    block, kinds = zoology_mixers(cfg, mixer)
    twin = Twin(ours, kinds, block)
    tc = cfg.train_config(mixer, 32, cfg.lrs[0], 0).resolved()
    opt = make_optimizer(ours, tc)
    params = list(twin.parameters())
    topt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": tc.weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=1e-8, foreach=False)
    assert sum(p.numel() for p in params) == ours.n_params
    rng, losses = np.random.default_rng(9), []
    for step in range(steps):
        pairs, t = cfg.schedule(step)
        d = mqar_batch(rng, cfg.batch, pairs, t, cfg.vocab_size)
        a = ours.loss(d["inputs"], d["targets"])
        ours.backward()
        opt.step(lr_at(step, tc))
        topt.zero_grad()
        b = twin.loss(d["inputs"], d["targets"])
        b.backward()
        for g in topt.param_groups:
            g["lr"] = lr_at(step, tc)
        topt.step()
        losses.append((a, float(b.detach())))
    return np.array(losses)


@pytest.mark.parametrize("mixer", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m
                                   for m in MIXERS + HYBRIDS])
def test_fifty_steps_equal_the_torch_twin(mixer):
    losses = train_both(mixer, 50)
    rel = np.abs(losses[:, 0] - losses[:, 1]) / np.abs(losses[:, 1])
    assert rel.max() <= 1e-9, (mixer, rel.max(), losses[-1])
    assert np.ptp(losses[:, 0]) > 1e-3                  # and the weights moved


def test_zoology_models_are_zoology_shaped():
    cfg = MQARConfig()
    assert zoology_mixers(cfg, "mamba2") == ("mamba2", ["mamba2", "mamba2"])
    assert zoology_mixers(cfg, "gated_delta") == ("transformer", ["baseconv", "gated_delta"])
    m = zoology_model(cfg, "gated_delta", 64, 0)
    gdn = m.mixers[1]
    assert not gdn.use_gate and gdn.eps == 1e-5 and (gdn.n_k_heads, gdn.d_k, gdn.d_v) == (2, 32, 64)
    assert not any("mlp" in k for k in m.params) and "backbone.layers.1.norm2.weight" in m.params
    assert np.exp(gdn.params["A_log"]).max() <= 16
    w = m.params["backbone.layers.0.sequence_mixer.W_proj"]
    assert abs(w.std() - 0.02) < 0.002 and not m.params["backbone.layers.0.sequence_mixer.b_proj"].any()
    att = zoology_model(cfg, "attention", 64, 0).mixers[1]
    assert att.n_heads == 1 and not att.rope and att.dropout == 0.1


def test_model_config_errors_name_the_argument():
    from qkv.errors import ShapeError

    with pytest.raises(ShapeError, match="model"):
        MQARConfig(model="zoo").check()
    with pytest.raises(ShapeError, match="embed_dropout"):
        MQARConfig(embed_dropout=1.0).check()
    with pytest.raises(ShapeError, match="widths"):
        MQARConfig(mixers=("mamba2",), widths=(48,), n_head=2).check()
