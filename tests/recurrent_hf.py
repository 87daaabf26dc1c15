"""transformers' recurrent modules as the outside reference of qkv.nn's Mamba2, GatedDeltaNet and RGLRU.

transformers computes these modules' recurrences in float32 even in a ``.double()`` module
(``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``, ``acc_dtype=torch.float32``
inside). :func:`float64` keeps those float64 while it is active, so the module's own code runs
in float64 and the layers can be held to 1e-10; without it the module is the float32 peer.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

torch = None


def _torch():
    global torch
    import torch as t
    torch = t
    return t


class _Torch64:
    """``torch`` with float32 read as float64, seen by transformers' modeling modules in place of
    torch itself (their ``dtype=torch.float32`` and ``acc_dtype=torch.float32`` arguments)."""

    def __init__(self, real):
        self._real = real
        self.float32 = self.float = real.float64

    def __getattr__(self, name):
        return getattr(self._real, name)


def _modeling_modules(extra=()):
    """transformers' modeling modules of the three recurrent families (those installed), and ``extra``."""
    import importlib

    names = ("mamba2.modeling_mamba2", "qwen3_next.modeling_qwen3_next", "recurrent_gemma.modeling_recurrent_gemma",
             "falcon_h1.modeling_falcon_h1") + tuple(m for _, m, _ in GATED_DELTA_FAMILIES.values())
    found = list(extra)
    for name in names:
        try:
            found.append(importlib.import_module(f"transformers.models.{name}"))
        except ImportError:
            pass
    return found


@contextlib.contextmanager
def float64(extra=()):
    """While active, transformers' recurrent modules compute a float64 module in float64: a float64
    tensor cast to float32 (``.float()``, ``.to``, ``.type``) stays float64, the modeling modules'
    ``torch.float32`` is float64, and RecurrentGemma's scan accumulates in float64. The one float64
    patch of the tests (tests/layers/test_recurrent_layers.py and tests/torch_hf/test_torch_recurrent_layers.py);
    ``extra``: more modeling modules to patch (tests/torch_hf/test_hf_hybrid_families.py)."""
    t = _torch()
    real_float, real_to, real_type = t.Tensor.float, t.Tensor.to, t.Tensor.type
    modules = _modeling_modules(extra)
    saved = [(m, m.torch) for m in modules]
    rg = next((m for m in modules if hasattr(m, "RecurrentGemmaRglru")), None)
    scan_defaults = rg.RecurrentGemmaRglru._rnn_scan.__defaults__ if rg is not None else None

    def keep(self, dtype):
        return t.float64 if (dtype is t.float32 and self.dtype == t.float64) else dtype

    def to(self, *args, **kwargs):
        args = tuple(keep(self, a) if isinstance(a, t.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = keep(self, kwargs["dtype"])
        return real_to(self, *args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        if dtype is None:
            return real_type(self)
        return real_type(self, keep(self, dtype), *args, **kwargs)

    t.Tensor.float = lambda self, *a, **k: self if self.dtype == t.float64 else real_float(self, *a, **k)
    t.Tensor.to, t.Tensor.type = to, type_
    for m in modules:
        m.torch = _Torch64(t)
    if rg is not None:
        rg.RecurrentGemmaRglru._rnn_scan.__defaults__ = (t.float64,)
    try:
        yield
    finally:
        t.Tensor.float, t.Tensor.to, t.Tensor.type = real_float, real_to, real_type
        for m, real in saved:
            m.torch = real
        if rg is not None:
            rg.RecurrentGemmaRglru._rnn_scan.__defaults__ = scan_defaults


def perturb(module, seed: int) -> None:
    """Replace every parameter with a random one of the same shape and scale (no zeros or ones)."""
    t = _torch()
    g = t.Generator().manual_seed(seed)
    with t.no_grad():
        for name, p in module.named_parameters():
            base = p.detach().abs().mean().clamp(min=0.3)
            p.copy_(p + base * 0.5 * t.randn(p.shape, generator=g, dtype=p.dtype))


def tensor(a: np.ndarray, grad: bool = False):
    t = _torch()
    return t.tensor(a, requires_grad=grad)


def numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy()


def rel(a, b) -> float:
    """``max |a - b| / max |b|``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# --- the modules ------------------------------------------------------------------------------
def mamba2(*, hidden=16, heads=4, head_dim=8, state=8, groups=1, conv=4, bias=False, conv_bias=True,
           limit=(0.0, float("inf")), seed=0):
    t = _torch()
    from transformers.models.mamba2.configuration_mamba2 import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    t.manual_seed(seed)
    cfg = Mamba2Config(hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=state, n_groups=groups,
                       conv_kernel=conv, expand=heads * head_dim // hidden, use_bias=bias, use_conv_bias=conv_bias,
                       time_step_limit=limit, num_hidden_layers=1, chunk_size=8, vocab_size=11)
    m = Mamba2Mixer(cfg, layer_idx=0).eval()
    perturb(m, seed)
    with t.no_grad():
        m.A_log.copy_(t.log(t.linspace(0.5, 3.0, heads)))        # decays of every speed, none trivial
        m.dt_bias.copy_(t.linspace(-2.0, 1.0, heads))
    return m, cfg


def falcon_h1(*, hidden=16, heads=4, head_dim=8, state=8, groups=1, conv=4, rms_norm=True, before_gate=True,
              multipliers=(0.5, 1.5, 0.75, 1.25, 0.9), in_multiplier=1.3, proj_bias=False, out_bias=False, seed=0):
    """Falcon-H1's Mamba-2 mixer with its own settings: the norm after the gate or before it or
    none (``mamba_rms_norm``), the µP multipliers (the ``mup_vector`` buffer FalconH1Model gives
    each mixer) and in_proj's and out_proj's biases apart."""
    t = _torch()
    from transformers.models.falcon_h1.configuration_falcon_h1 import FalconH1Config
    from transformers.models.falcon_h1 import modeling_falcon_h1 as fh
    t.manual_seed(seed)
    cfg = FalconH1Config(hidden_size=hidden, mamba_n_heads=heads, mamba_d_head=head_dim, mamba_d_ssm=heads * head_dim,
                         mamba_d_state=state, mamba_n_groups=groups, mamba_d_conv=conv, mamba_rms_norm=rms_norm,
                         mamba_norm_before_gate=before_gate, ssm_multipliers=list(multipliers),
                         ssm_in_multiplier=in_multiplier, mamba_proj_bias=proj_bias, projectors_bias=out_bias,
                         mamba_chunk_size=8, num_hidden_layers=1, vocab_size=11, num_attention_heads=2,
                         num_key_value_heads=1)
    m = fh.FalconH1Mixer(cfg, layer_idx=0).eval()
    m.register_buffer("mup_vector", fh.compute_mup_vector(cfg), persistent=False)
    perturb(m, seed)
    with t.no_grad():
        m.A_log.copy_(t.log(t.linspace(0.5, 3.0, heads)))
        m.dt_bias.copy_(t.linspace(-2.0, 1.0, heads))
    return m, cfg


def gated_delta(*, hidden=16, k_heads=2, v_heads=4, k_dim=8, v_dim=8, conv=4, seed=0):
    t = _torch()
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    t.manual_seed(seed)
    cfg = Qwen3NextConfig(hidden_size=hidden, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                          linear_key_head_dim=k_dim, linear_value_head_dim=v_dim, linear_conv_kernel_dim=conv,
                          num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=11,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    m = Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    perturb(m, seed)
    return m, cfg


GATED_DELTA_FAMILIES = {  # kind -> (tests/hf_hybrid.py's family, modeling module, the layer's class)
    "qwen3_5": ("Qwen3.5", "qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe": ("Qwen3.5-MoE", "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    "olmo_hybrid": ("OLMo-Hybrid", "olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"),
}


def gated_delta_family(kind: str, *, seed=0, **config):
    """The Gated DeltaNet layer (layer 0) of a family other than Qwen3-Next: hf_hybrid's tiny config
    (hidden 32, 2 key heads and 4 value heads of 8, conv 4; OLMo-Hybrid's ``allow_neg_eigval`` on, its
    default) with ``config`` (transformers' names) over it, every weight moved off its init."""
    import importlib

    import hf_hybrid as H
    t = _torch()
    from transformers import CONFIG_MAPPING
    family, module, cls = GATED_DELTA_FAMILIES[kind]
    model_type, overrides = H.FAMILIES[family]
    cfg = CONFIG_MAPPING[model_type](**{**overrides, **config})
    t.manual_seed(seed)
    m = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(cfg, layer_idx=0).eval()
    perturb(m, seed)
    return m, cfg


def rglru(*, hidden=16, lru_width=24, heads=3, conv=4, seed=0):
    t = _torch()
    from transformers.models.recurrent_gemma.configuration_recurrent_gemma import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock
    t.manual_seed(seed)
    cfg = RecurrentGemmaConfig(hidden_size=hidden, lru_width=lru_width, num_attention_heads=heads,
                               conv1d_width=conv, num_hidden_layers=1, vocab_size=11, intermediate_size=32)
    m = RecurrentGemmaRecurrentBlock(cfg, layer_idx=0).eval()
    with t.no_grad():
        for p in m.parameters():
            p.copy_(t.randn(p.shape, dtype=p.dtype) / max(1.0, p.shape[-1] ** 0.5))
        m.rg_lru.recurrent_param.copy_(t.linspace(-1.0, 2.0, lru_width))
    return m, cfg


# --- calling them: the whole sequence, and cached decoding (a prefill, then one token a call) ---
def full(kind: str, module, x):
    """The module's output on the whole sequence ``x`` (a tensor), no cache."""
    t = _torch()
    if kind == "rglru":
        B, T = x.shape[:2]
        return module(x, t.arange(T)[None].expand(B, T), None, use_cache=False)[0]
    return module(x)


def decode(kind: str, module, cfg, x: np.ndarray, prefill: int) -> np.ndarray:
    """The module's outputs when it is given ``x[:, :prefill]`` and then one token a call, with its cache."""
    t = _torch()
    B, T = x.shape[:2]
    pieces = [(0, prefill)] + [(i, i + 1) for i in range(prefill, T)]
    outs = []
    if kind == "rglru":
        for a, b in pieces:
            pos = t.arange(a, b)[None].expand(B, b - a)
            outs.append(module(tensor(x[:, a:b]), pos, None, use_cache=True)[0])
    else:
        from transformers import DynamicCache
        cache = DynamicCache(config=cfg)
        outs = [module(tensor(x[:, a:b]), cache=cache) for a, b in pieces]
    return numpy(t.cat(outs, 1))


def hf_grads(layer_class, module) -> dict:
    """transformers' parameter gradients under our names: ``from_hf`` of the module with each
    weight swapped for its gradient (the weights are put back)."""
    t = _torch()
    params = list(module.parameters())
    saved = [p.detach().clone() for p in params]
    with t.no_grad():
        for p in params:
            p.copy_(p.grad)
        try:
            return dict(layer_class.from_hf(module, dtype=np.float64).params)
        finally:
            for p, w in zip(params, saved):
                p.copy_(w)


BUILD = {"mamba2": mamba2, "falcon_h1": falcon_h1, "gated_delta": gated_delta, "rglru": rglru,
         **{kind: functools.partial(gated_delta_family, kind) for kind in GATED_DELTA_FAMILIES}}
