"""What a transformers recurrent module computes, read off the module itself: the settings of
the qkv layer that computes the same function, or a ShapeError that names the module's class
and the setting qkv does not compute.

A module is taken for what it is, not for its class name: transformers' Mamba-2 mixers
(``Mamba2Mixer``, ``BambaMixer``, ``NemotronHMamba2Mixer``, ``Zamba2MambaMixer``,
``GraniteMoeHybridMambaLayer``, ``FalconH1Mixer``) share one forward and differ in settings
the module carries, each read here:

- the gated RMSNorm: gate first, ``rms_G(y ∘ silu(z)) ∘ w`` (Mamba-2's, and Falcon-H1's with
  ``norm_before_gate=False``), or gate after, ``rms_G(y) ∘ w ∘ silu(z)`` (Falcon-H1's
  default ``norm_before_gate=True``), or none, ``y ∘ silu(z)`` (Falcon-H1 with
  ``mamba_rms_norm=False``, whose ``norm`` is an ``Identity``); its groups must be the B/C groups;
- Falcon-H1's µP multipliers: ``x · ssm_in_multiplier`` before ``in_proj`` and the projection
  times ``mup_vector`` (one factor a column: z, x, B, C, dt from ``ssm_multipliers``);
- the biases of ``in_proj`` and ``out_proj`` apart (Falcon-H1 sets them by two options);
- the conv activation (SiLU) and ``time_step_limit``.

Used by both :meth:`qkv.nn.Mamba2.from_hf` and :meth:`qkv.torch.Mamba2.from_hf`.

transformers' Gated DeltaNet layers compute one function under three weight layouts
(:data:`GATED_DELTA_LAYOUTS`), each known by its weights: Qwen3-Next's two projections
interleaved per key head; Qwen3.5's (and Qwen3.5-MoE's) ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``; OLMo-Hybrid's ``q_proj`` ... ``g_proj`` (the gate z), ``o_proj`` and
``o_norm``. OLMo-Hybrid's ``allow_neg_eigval`` (its default) doubles beta, ``beta = 2·sigmoid(b)``
in (0, 2), which qkv's layers compute under the same name. Read by both
:meth:`qkv.nn.GatedDeltaNet.from_hf` and :meth:`qkv.torch.GatedDeltaNet.from_hf`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError

NORMS = ("gate_then_norm", "norm_then_gate", "none")
SILU = ("silu", "swish")


def require(module, where: str, kind: str, needs: tuple[str, ...]) -> None:
    """``module`` is a torch module with the attributes ``needs`` of a transformers ``kind``."""
    missing = [n for n in needs if not hasattr(module, n)] if hasattr(module, "named_parameters") else ["parameters"]
    if missing:
        raise ShapeError(f"{where} needs a transformers {kind}; got {type(module).__name__} (no {', '.join(missing)})")


def refuse(where: str, module, setting: str) -> ShapeError:
    """The error for a setting of ``module`` that the qkv layer does not compute."""
    return ShapeError(f"{where}: {type(module).__name__} {setting}, which qkv's layer does not compute")


MAMBA2_NEEDS = ("hidden_size", "num_heads", "head_dim", "intermediate_size", "ssm_state_size", "n_groups",
                "conv_kernel_size", "time_step_limit", "activation", "norm", "in_proj", "out_proj", "conv1d",
                "A_log", "D", "dt_bias")


def mamba2_settings(module, where: str) -> dict:
    """The keyword arguments of qkv's Mamba-2 layer (NumPy and torch alike) that compute what
    the transformers Mamba-2 mixer ``module`` computes::

        d_model, n_heads, head_dim, state_size, n_groups, conv_kernel, bias, out_bias, conv_bias,
        eps, dt_limit, norm (one of NORMS), in_multiplier (float), proj_scale ((I + C + H,) or None)
    """
    require(module, where, "Mamba-2 mixer", MAMBA2_NEEDS)
    H, P, N, G = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    inner = H * P
    if module.intermediate_size != inner:
        raise ShapeError(f"{where}: intermediate_size {module.intermediate_size} must be "
                         f"num_heads * head_dim = {H} * {P}")
    if module.activation not in SILU:
        raise refuse(where, module, f"has the conv activation {module.activation!r} (qkv's is silu)")
    norm, eps = _mamba2_norm(module, where, inner, G)
    width = inner + (inner + 2 * G * N) + H
    in_multiplier = float(getattr(module, "ssm_in_multiplier", 1.0))
    scale = getattr(module, "mup_vector", None)
    if scale is not None:
        scale = scale.detach().cpu().double().numpy().reshape(-1)
        if scale.shape != (width,):
            raise ShapeError(f"{where}: {type(module).__name__}.mup_vector must have the projection's width "
                             f"I + C + H = {width}; got {scale.shape}")
        scale = None if np.all(scale == 1.0) else scale
    return dict(d_model=module.hidden_size, n_heads=H, head_dim=P, state_size=N, n_groups=G,
                conv_kernel=module.conv_kernel_size, bias=module.in_proj.bias is not None,
                out_bias=module.out_proj.bias is not None, conv_bias=module.conv1d.bias is not None, eps=eps,
                dt_limit=tuple(module.time_step_limit), norm=norm, in_multiplier=in_multiplier, proj_scale=scale)


def _mamba2_norm(module, where: str, inner: int, groups: int) -> tuple[str, float]:
    """``(norm, eps)``: which gated norm the mixer applies, after checking its groups."""
    norm = module.norm
    if getattr(module, "mamba_rms_norm", True) is False:   # Falcon-H1: y ∘ silu(z), the norm unused
        if any(True for _ in norm.parameters()):
            raise refuse(where, module, "has mamba_rms_norm=False and a norm with weights")
        return "none", 1e-5
    if not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
        raise refuse(where, module, f"has the norm {type(norm).__name__} (qkv's is a gated RMSNorm)")
    if getattr(norm, "activation", "silu") not in SILU:
        raise refuse(where, module, f"gates its norm with {norm.activation!r} (qkv's gate is silu)")
    if hasattr(norm, "group_size"):
        norm_groups = inner // norm.group_size if norm.group_size and inner % norm.group_size == 0 else None
    else:
        norm_groups = getattr(norm, "n_groups", 1)
    if norm_groups != groups:
        raise refuse(where, module, f"normalises over groups of {getattr(norm, 'group_size', None) or '?'} "
                                    f"channels ({norm_groups} groups), not its n_groups = {groups}")
    kind = "norm_then_gate" if getattr(norm, "norm_before_gate", False) else "gate_then_norm"
    return kind, float(norm.variance_epsilon)


@dataclass(frozen=True)
class GatedDeltaLayout:
    """Where a transformers Gated DeltaNet keeps its weights: its input projections, each with the
    parts (``q k v z b a``) it holds in order, the norm's and the output projection's names, and
    whether the parts are interleaved per key head (Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba``)."""

    family: str
    projections: tuple[tuple[str, str], ...]
    norm: str = "norm"
    out: str = "out_proj"
    interleaved: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.projections) + (self.norm, self.out)


GATED_DELTA_LAYOUTS = {
    "qwen3_next": GatedDeltaLayout("Qwen3-Next", (("in_proj_qkvz", "qkvz"), ("in_proj_ba", "ba")), interleaved=True),
    "qwen3_5": GatedDeltaLayout("Qwen3.5", (("in_proj_qkv", "qkv"), ("in_proj_z", "z"), ("in_proj_b", "b"),
                                            ("in_proj_a", "a"))),
    "olmo_hybrid": GatedDeltaLayout("OLMo-Hybrid", (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("a_proj", "a"),
                                                    ("b_proj", "b"), ("g_proj", "z")), norm="o_norm", out="o_proj"),
}


def gated_delta_widths(n_k_heads: int, n_v_heads: int, d_k: int, d_v: int) -> dict[str, int]:
    """The width of each part of the input projection, in ``W_in``'s column order: ``q, k`` (Hk·Dk),
    ``v, z`` (Hv·Dv), ``b, a`` (Hv)."""
    kd, vd = n_k_heads * d_k, n_v_heads * d_v
    return dict(q=kd, k=kd, v=vd, z=vd, b=n_v_heads, a=n_v_heads)


GATED_DELTA_NEEDS = ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size",
                     "activation", "conv1d", "A_log", "dt_bias")


def gated_delta_layout(module, where: str) -> str:
    """The name of the :data:`GATED_DELTA_LAYOUTS` entry whose weights ``module`` has."""
    for name, layout in GATED_DELTA_LAYOUTS.items():
        if all(hasattr(module, n) for n in layout.names):
            return name
    known = "; ".join(f"{lay.family}'s {', '.join(lay.names)}" for lay in GATED_DELTA_LAYOUTS.values())
    raise ShapeError(f"{where} needs a transformers Gated DeltaNet layer ({known}); got {type(module).__name__}, "
                     f"which has none of these sets")


def gated_delta_settings(module, where: str) -> dict:
    """The arguments of qkv's Gated DeltaNet for a transformers Gated DeltaNet layer ``module``
    (Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's, OLMo-Hybrid's, told apart by their weights)::

        d_model, n_k_heads, n_v_heads, d_k, d_v, conv_kernel, eps,
        allow_neg_eigval (beta = 2·sigmoid(b), OLMo-Hybrid's), layout (a GATED_DELTA_LAYOUTS key)
    """
    require(module, where, "Gated DeltaNet layer", GATED_DELTA_NEEDS)
    layout = gated_delta_layout(module, where)
    lay = GATED_DELTA_LAYOUTS[layout]
    if module.activation not in SILU:
        raise refuse(where, module, f"has the conv activation {module.activation!r} (qkv's is silu)")
    norm = getattr(module, lay.norm)
    if not (hasattr(norm, "weight") and hasattr(norm, "variance_epsilon")):
        raise refuse(where, module, f"has the norm {type(norm).__name__} (qkv's is a gated RMSNorm)")
    if getattr(norm, "activation", "silu") not in SILU:
        raise refuse(where, module, f"gates its norm with {norm.activation!r} (qkv's gate is silu)")
    for name in [n for n, _ in lay.projections] + [lay.out, "conv1d"]:
        if getattr(getattr(module, name), "bias", None) is not None:
            raise refuse(where, module, f"has a bias in {name}")
    neg = getattr(module, "allow_neg_eigval", False)
    if not isinstance(neg, bool):
        raise refuse(where, module, f"has allow_neg_eigval = {neg!r} (qkv reads True or False)")
    return dict(d_model=module.hidden_size, n_k_heads=module.num_k_heads, n_v_heads=module.num_v_heads,
                d_k=module.head_k_dim, d_v=module.head_v_dim, conv_kernel=module.conv_kernel_size,
                eps=float(norm.variance_epsilon), allow_neg_eigval=neg, layout=layout)


RGLRU_NEEDS = ("hidden_size", "lru_width", "rg_lru", "conv1d_width", "act_fn", "linear_x", "linear_y",
               "linear_out", "conv_1d")
