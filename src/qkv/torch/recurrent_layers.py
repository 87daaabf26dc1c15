"""Mamba-2 and Gated DeltaNet mixers as ``nn.Module``s on qkv's recurrence operators.

Both are the layers of transformers (``Mamba2Mixer``; ``Qwen3NextGatedDeltaNet``,
``Qwen3_5GatedDeltaNet``, ``OlmoHybridGatedDeltaNet``), their parameters under the same names,
with the recurrence computed by :func:`qkv.torch.decay_attention` / :func:`qkv.torch.delta_rule`.

**Mamba-2 as decayed attention.** Per head h (of ``H``, in ``G`` groups sharing ``B`` and
``C``), with ``Δ_t = softplus(dt_t + dt_bias)`` and ``A = -exp(A_log)``, the SSM is::

    h_t = exp(Δ_t A) h_{t-1} + B_t (Δ_t x_t)ᵀ        h_t: (N, P), B_t, C_t: (N,), x_t: (P,)
    y_t = h_tᵀ C_t + D x_t

which is :func:`~qkv.torch.decay_attention` with ``q = C``, ``k = B``, ``v = Δ x``,
``log_decay = Δ A`` (one decay a head) and ``scale = 1``; ``D x`` is added after. The state
is qkv's ``(Dk, Dv) = (N, P)``, the transpose of transformers' ``(P, N)``.

**Gated DeltaNet.** With ``q, k`` L2-normalised (``x / sqrt(Σx² + 1e-6)``), ``β =
sigmoid(b)`` (``2·sigmoid(b)`` with ``allow_neg_eigval``, OLMo-Hybrid's) and ``g = -exp(A_log) ·
softplus(a + dt_bias)``, the state follows the gated delta rule (:func:`~qkv.torch.delta_rule`,
scale ``1/sqrt(d_k)``). With fewer key heads than value heads each key head serves ``n_v / n_k``
consecutive value heads. The projections of q, k, v, the gate z, b and a are laid out as one of
transformers' layers (``layout``, :data:`qkv.nn.hf_variants.GATED_DELTA_LAYOUTS`), under its names.

Both then normalise with a gate ``z``: Mamba-2 ``rms_G(y · silu(z)) · w`` (RMS over each of the
G groups of channels), Gated DeltaNet ``rms(y) · w · silu(z)`` over each head; in float32
(float64 kept), as transformers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OptionError, ShapeError, positive_int
from ..nn.hf_variants import GATED_DELTA_LAYOUTS, NORMS, gated_delta_settings, gated_delta_widths, mamba2_settings
from ..options import parse_flag
from .layer_state import (NormWeight, RecurrentState, activation as activation_fn, causal_conv, check_input,
                          check_state, load_hf, wide)
from .recurrent_ops import decay_attention, delta_rule


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, T, heads·D) -> (B, heads, T, D)``."""
    B, T, _ = x.shape
    return x.reshape(B, T, heads, x.shape[-1] // heads).transpose(1, 2)


def _result(out, conv_window, final, return_state: bool):
    return (out, RecurrentState(conv_window, final)) if return_state else out


class Mamba2(nn.Module):
    """Mamba-2's mixer (transformers' ``Mamba2Mixer``): in_proj -> causal conv + SiLU -> SSM
    (qkv's decayed attention) -> gated grouped RMS norm -> out_proj.

    Args:
        d_model: the width of x. n_heads, head_dim: ``n_heads · head_dim`` is the inner width.
        state_size: ``N``. n_groups: groups sharing B and C (divides n_heads).
        conv_kernel: the causal convolution's width. conv_bias, bias: biases of the conv and
            of the projections. eps: the norm's. time_step_limit: ``(lo, hi)`` clamp of Δ.
        activation: the conv's (a transformers name). chunk_size: qkv's chunk (None: default).
        out_bias: out_proj's bias (None: as ``bias``). norm: ``"gate_then_norm"`` (Mamba-2's
            ``rms_G(y · silu(z)) · w``), ``"norm_then_gate"`` (``rms_G(y) · w · silu(z)``, Falcon-H1's
            default) or ``"none"`` (``y · silu(z)``). ssm_in_multiplier, mup_vector: Falcon-H1's µP
            factors, ``in_proj(x · m) · mup_vector`` (a constant buffer ``(I + C + H,)``, None: ones).

    ``forward(x (B, T, d_model), state=None, *, return_state=False)``; ``state`` (a
    :class:`RecurrentState` from an earlier call) continues a sequence, None starts one.
    Δ is clamped to ``time_step_limit`` on every call (transformers clamps it in its chunked
    form only; with the default ``(0, inf)`` the two agree). No padding mask: a batch's
    sequences run their whole length.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, state_size: int = 128, n_groups: int = 1,
                 conv_kernel: int = 4, conv_bias: bool = True, bias: bool = False, eps: float = 1e-5,
                 time_step_limit=(0.0, math.inf), activation: str = "silu", chunk_size: int | None = None,
                 out_bias: bool | None = None, norm: str = "gate_then_norm", ssm_in_multiplier: float = 1.0,
                 mup_vector=None, dtype=None, device=None):
        super().__init__()
        if norm not in NORMS:
            raise OptionError(f"norm must be one of {NORMS}; got {norm!r}")
        self.norm_kind, self.ssm_in_multiplier = norm, float(ssm_in_multiplier)
        self.d_model, self.n_heads, self.head_dim = (positive_int(n, v) for n, v in
                                                     (("d_model", d_model), ("n_heads", n_heads),
                                                      ("head_dim", head_dim)))
        self.state_size, self.n_groups = positive_int("state_size", state_size), positive_int("n_groups", n_groups)
        if n_heads % n_groups:
            raise ShapeError(f"n_groups must divide n_heads = {n_heads}; got {n_groups}")
        self.d_inner = n_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * state_size
        self.eps, self.time_step_limit, self.chunk_size = float(eps), tuple(time_step_limit), chunk_size
        self.activation, self.act = activation, activation_fn(activation)
        kw = dict(dtype=dtype, device=device)
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + n_heads, bias=bias, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_kernel - 1, **kw)
        self.dt_bias = nn.Parameter(torch.empty(n_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n_heads + 1, **kw)))   # A = -1, -2, ..., -H
        self.D = nn.Parameter(torch.ones(n_heads, **kw))
        if norm != "none":
            self.norm = NormWeight(self.d_inner, **kw)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias if out_bias is None else out_bias, **kw)
        width = self.d_inner + self.conv_dim + n_heads
        if mup_vector is not None:
            mup_vector = torch.as_tensor(mup_vector, **kw).reshape(-1)
            if mup_vector.shape != (width,):
                raise ShapeError(f"mup_vector must have shape (I + C + H,) = ({width},); "
                                 f"got {tuple(mup_vector.shape)}")
        self.register_buffer("mup_vector", mup_vector, persistent=False)
        with torch.no_grad():   # Δ log-uniform in [1e-3, 1e-1] at dt = 0: dt_bias = softplus⁻¹(Δ)
            dt = torch.exp(torch.rand(n_heads, **kw) * math.log(100) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"state_size={self.state_size}, n_groups={self.n_groups}")

    def forward(self, x, state: RecurrentState | None = None, *, return_state: bool = False):
        """``y (B, T, d_model)``; with ``return_state``, ``(y, state)`` to continue from."""
        check_input(self, x, self.d_model)
        window = check_state(state, x.shape[0], self.conv1d)
        B, T, _ = x.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.state_size
        proj = self.in_proj(x * self.ssm_in_multiplier if self.ssm_in_multiplier != 1.0 else x)
        if self.mup_vector is not None:
            proj = proj * self.mup_vector
        z, xbc, dt = proj.split([self.d_inner, self.conv_dim, H], dim=-1)
        xbc, window = causal_conv(xbc, self.conv1d, window)
        xs, Bs, Cs = self.act(xbc).split([self.d_inner, G * N, G * N], dim=-1)
        dt = F.softplus(dt + self.dt_bias).clamp(*self.time_step_limit)      # Δ (B, T, H)
        A = -torch.exp(self.A_log)                                            # (H,)
        xh = _heads(xs, H)                                                    # (B, H, T, P)
        k = _heads(Bs, G).repeat_interleave(H // G, dim=1)                   # (B, G, T, N) -> (B, H, T, N)
        q = _heads(Cs, G).repeat_interleave(H // G, dim=1)
        dt = dt.transpose(1, 2)                                               # (B, H, T)
        o, final = decay_attention(q, k, xh * dt[..., None], dt * A[:, None], scale=1.0,
                                   initial_state=None if state is None else state.recurrent,
                                   return_state=True, chunk_size=self.chunk_size)  # (B, H, T, P)
        y = (o + self.D[:, None, None] * xh).transpose(1, 2).reshape(B, T, self.d_inner)
        return _result(self.out_proj(self._gated_norm(y, z)), window, final, return_state)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``rms_G(y · silu(z)) · w`` (RMS over each of the G groups of channels), ``rms_G(y) · w ·
        silu(z)`` or ``y · silu(z)``, as ``norm`` says."""
        if self.norm_kind == "none":
            return y * F.silu(z)
        gate_first = self.norm_kind == "gate_then_norm"
        h = wide(y) * F.silu(wide(z)) if gate_first else wide(y)
        g = h.reshape(*h.shape[:-1], self.n_groups, self.d_inner // self.n_groups)   # (B, T, G, d_inner/G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if gate_first:
            return self.norm.weight * g.reshape(h.shape).to(y.dtype)
        return (self.norm.weight * g.reshape(h.shape) * F.silu(wide(z))).to(y.dtype)

    @classmethod
    def from_hf(cls, mixer) -> "Mamba2":
        """This layer with the weights of a transformers Mamba-2 mixer (``Mamba2Mixer``, and
        Bamba's, Nemotron-H's, Zamba-2's, Granite's and Falcon-H1's with its norm variants and µP
        multipliers), copied and shape-checked; a setting it does not compute is refused by name
        (:func:`qkv.nn.hf_variants.mamba2_settings`)."""
        st = mamba2_settings(mixer, "qkv.torch.Mamba2.from_hf")
        w = mixer.in_proj.weight
        layer = cls(st["d_model"], st["n_heads"], st["head_dim"], state_size=st["state_size"],
                    n_groups=st["n_groups"], conv_kernel=st["conv_kernel"], conv_bias=st["conv_bias"],
                    bias=st["bias"], out_bias=st["out_bias"], eps=st["eps"], time_step_limit=st["dt_limit"],
                    activation=mixer.activation, norm=st["norm"], ssm_in_multiplier=st["in_multiplier"],
                    mup_vector=None if st["proj_scale"] is None else mixer.mup_vector.reshape(-1),
                    dtype=w.dtype, device=w.device)
        load_hf(layer, mixer, type(mixer).__name__)
        return layer


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (transformers' ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``,
    ``OlmoHybridGatedDeltaNet``): input projections -> causal conv + SiLU over q, k, v ->
    L2-normalised q, k -> the gated delta rule (qkv) -> gated RMS norm per head -> output projection.

    Args:
        d_model: the width of x. n_k_heads, n_v_heads: key and value heads (n_k_heads divides
            n_v_heads). d_k, d_v: their widths. conv_kernel: the convolution's width.
        eps: the norm's. activation: the conv's. chunk_size: qkv's chunk (None: default).
        layout: whose weights, under whose names: ``"qwen3_next"`` (``in_proj_qkvz``,
            ``in_proj_ba`` interleaved per key head; ``norm``, ``out_proj``), ``"qwen3_5"``
            (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; ``norm``, ``out_proj``) or
            ``"olmo_hybrid"`` (``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, ``g_proj``;
            ``o_norm``, ``o_proj``). The same function whichever.
        allow_neg_eigval: beta = 2·sigmoid(b) in (0, 2) (OLMo-Hybrid's default), else sigmoid(b).
        use_gate: the output gate silu(z) (default); False: no z projection, ``rms(o) · w`` (fla's
            ``use_gate=False``, Zoology's MQAR setting), with a layout that keeps z apart
            (``"olmo_hybrid"``, fla's names, or ``"qwen3_5"``).

    ``forward(x (B, T, d_model), state=None, *, return_state=False)`` as :class:`Mamba2`.
    """

    def __init__(self, d_model: int, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int, *, conv_kernel: int = 4,
                 eps: float = 1e-6, activation: str = "silu", chunk_size: int | None = None,
                 layout: str = "qwen3_next", allow_neg_eigval: bool = False, use_gate: bool = True, dtype=None,
                 device=None):
        super().__init__()
        for name, v in (("d_model", d_model), ("n_k_heads", n_k_heads), ("n_v_heads", n_v_heads), ("d_k", d_k),
                        ("d_v", d_v)):
            positive_int(name, v)
        if n_v_heads % n_k_heads:
            raise ShapeError(f"n_k_heads must divide n_v_heads = {n_v_heads}; got {n_k_heads}")
        if not isinstance(layout, str) or layout not in GATED_DELTA_LAYOUTS:
            raise OptionError(f"layout must be one of {tuple(GATED_DELTA_LAYOUTS)}; got {layout!r}")
        self.d_model, self.n_k_heads, self.n_v_heads, self.d_k, self.d_v = d_model, n_k_heads, n_v_heads, d_k, d_v
        self.key_dim, self.value_dim = n_k_heads * d_k, n_v_heads * d_v
        self.eps, self.chunk_size = float(eps), chunk_size
        self.activation, self.act = activation, activation_fn(activation)
        self.layout, self.allow_neg_eigval = layout, parse_flag("allow_neg_eigval", allow_neg_eigval)
        self._layout = GATED_DELTA_LAYOUTS[layout]
        self.use_gate = parse_flag("use_gate", use_gate)
        if not self.use_gate and self._layout.interleaved:
            raise OptionError(f"use_gate=False needs a layout whose z projection stands alone (olmo_hybrid, qwen3_5); "
                              f"got layout={layout!r}, whose in_proj_qkvz interleaves z")
        self._widths = gated_delta_widths(n_k_heads, n_v_heads, d_k, d_v)
        kw = dict(dtype=dtype, device=device)
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False,
                                padding=conv_kernel - 1, **kw)
        for name, parts in self._layout.projections:
            if parts == "z" and not self.use_gate:
                continue
            setattr(self, name, nn.Linear(d_model, sum(self._widths[p] for p in parts), bias=False, **kw))
        self.dt_bias = nn.Parameter(torch.empty(n_v_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.empty(n_v_heads, **kw).uniform_(1, 16)))
        setattr(self, self._layout.norm, NormWeight(d_v, **kw))
        setattr(self, self._layout.out, nn.Linear(self.value_dim, d_model, bias=False, **kw))
        with torch.no_grad():   # as qkv.nn.GatedDeltaNet: Mamba's Δ, log-uniform in [1e-3, 1e-1], not dt_bias = 1
            dt = torch.exp(torch.rand(n_v_heads, **kw) * math.log(100) + math.log(1e-3))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_k_heads={self.n_k_heads}, n_v_heads={self.n_v_heads}, "
                f"d_k={self.d_k}, d_v={self.d_v}, layout={self.layout!r}, allow_neg_eigval={self.allow_neg_eigval}"
                + ("" if self.use_gate else ", use_gate=False"))

    def _project(self, x: torch.Tensor) -> tuple:
        """``(qkv (B, T, 2·key_dim + value_dim), z (B, T, Hv, d_v), b, a (B, T, Hv))``."""
        if self._layout.interleaved:
            return self._project_interleaved(x)
        B, T, _ = x.shape
        parts = {}
        for name, held in self._layout.projections:                  # whole parts, in order
            if held == "z" and not self.use_gate:
                continue
            y = getattr(self, name)(x)                                # (B, T, Σ widths)
            parts.update(zip(held, y.split([self._widths[p] for p in held], dim=-1)))
        qkv = torch.cat([parts["q"], parts["k"], parts["v"]], dim=-1)
        z = parts["z"].reshape(B, T, self.n_v_heads, self.d_v) if self.use_gate else None
        return qkv, z, parts["b"], parts["a"]

    def _project_interleaved(self, x: torch.Tensor) -> tuple:
        """As :meth:`_project`; Qwen3-Next's projections are laid out per key head, ``[q, k, v·r, z·r]``
        and ``[b·r, a·r]`` with ``r = n_v / n_k`` (transformers' ``fix_query_key_value_ordering``)."""
        B, T, _ = x.shape
        Hk, r = self.n_k_heads, self.n_v_heads // self.n_k_heads
        split = [self.d_k, self.d_k, r * self.d_v, r * self.d_v]
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, Hk, sum(split)).split(split, dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, Hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(B, T, Hk * t.shape[-1]) for t in (q, k, v)], dim=-1)
        Hv = self.n_v_heads
        return qkv, z.reshape(B, T, Hv, self.d_v), b.reshape(B, T, Hv), a.reshape(B, T, Hv)

    def forward(self, x, state: RecurrentState | None = None, *, return_state: bool = False):
        """``y (B, T, d_model)``; with ``return_state``, ``(y, state)`` to continue from."""
        check_input(self, x, self.d_model)
        window = check_state(state, x.shape[0], self.conv1d)
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        qkv, window = causal_conv(qkv, self.conv1d, window)
        q, k, v = self.act(qkv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (_heads(t, self.n_k_heads) for t in (q, k))                             # (B, Hk, T, d_k)
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))   # L2 norm
        # value heads h·r .. h·r + r - 1 read key head h (r = Hv / Hk): qkv.torch.delta_rule's grouped heads
        beta = torch.sigmoid(b).transpose(1, 2)                                        # (B, Hv, T)
        if self.allow_neg_eigval:
            beta = beta * 2.0                                                          # in (0, 2)
        g = (-torch.exp(self.A_log) * F.softplus(a + self.dt_bias)).transpose(1, 2)    # (B, Hv, T)
        o, final = delta_rule(q, k, _heads(v, self.n_v_heads), beta, g,
                              initial_state=None if state is None else state.recurrent,
                              return_state=True, chunk_size=self.chunk_size)          # (B, Hv, T, d_v)
        o = o.transpose(1, 2)                                                          # (B, T, Hv, d_v)
        h = wide(o) * torch.rsqrt(wide(o).pow(2).mean(-1, keepdim=True) + self.eps)
        y = getattr(self, self._layout.norm).weight * h.to(o.dtype)
        if self.use_gate:
            y = y * F.silu(wide(z))
        out = getattr(self, self._layout.out)(y.to(o.dtype).reshape(B, T, self.value_dim))
        return _result(out, window, final, return_state)

    @classmethod
    def from_hf(cls, layer) -> "GatedDeltaNet":
        """This layer with the weights of a transformers Gated DeltaNet (Qwen3-Next's, Qwen3.5's,
        Qwen3.5-MoE's or OLMo-Hybrid's, known by its weights, under their names); a setting it does
        not compute is refused by name (:func:`qkv.nn.hf_variants.gated_delta_settings`)."""
        st = gated_delta_settings(layer, "qkv.torch.GatedDeltaNet.from_hf")
        w = layer.conv1d.weight
        ours = cls(st["d_model"], st["n_k_heads"], st["n_v_heads"], st["d_k"], st["d_v"],
                   conv_kernel=st["conv_kernel"], eps=st["eps"], activation=layer.activation, layout=st["layout"],
                   allow_neg_eigval=st["allow_neg_eigval"], dtype=w.dtype, device=w.device)
        load_hf(ours, layer, type(layer).__name__)
        return ours
