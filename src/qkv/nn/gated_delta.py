"""Gated DeltaNet (transformers' ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``,
``OlmoHybridGatedDeltaNet``) as a trainable NumPy layer.

Forward, for ``x (B, T, d_model)``, ``Hk`` key heads of width ``Dk`` and ``Hv`` value heads of
width ``Dv`` (``Hv`` a multiple of ``Hk``: value heads ``h·r .. h·r + r - 1`` share key head h,
``r = Hv/Hk``)::

    [q | k | v | z | b | a] = x W_in                       (Hk·Dk, Hk·Dk, Hv·Dv, Hv·Dv, Hv, Hv)
    [q | k | v] = silu(conv([q | k | v]))                  short causal depthwise conv, K taps
    q, k = l2norm(q), l2norm(k)                            per head, x (Σx² + 1e-6)^(-1/2)
    beta = sigmoid(b) (2·sigmoid(b): allow_neg_eigval),   g = -exp(A_log) softplus(a + dt_bias)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}ᵀ k_t))ᵀ      per value head
    o_t = S_tᵀ q_t / sqrt(Dk)                               delta_rule(q, k, v, beta, g)
    out = (norm_w ∘ rms(o) ∘ silu(z)) W_out                 RMSNorm per head, then the gate

**use_gate=False** (fla's and Zoology's option; Zoology's MQAR models set it): no z columns in
``W_in`` and no gate, ``out = (norm_w ∘ rms(o)) W_out``; its backward is the RMSNorm's alone,
``do = rms'(norm_w ∘ dflat)``, ``dnorm_w = Σ dflat ∘ rms(o)``.

``W_in`` holds transformers' input projections in the plain order above: Qwen3-Next's two
(``in_proj_qkvz``, ``in_proj_ba``) interleave them per key head
(``[q_h | k_h | v_{h·r..} | z_{h·r..}]`` and ``[b_{h·r..} | a_{h·r..}]``), which
:meth:`GatedDeltaNet.from_hf` undoes; Qwen3.5's four (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``) and OLMo-Hybrid's six (``q_proj``, ``k_proj``, ``v_proj``,
``g_proj`` = z, ``b_proj``, ``a_proj``) are those column blocks as they are.
The recurrence is :func:`qkv.recurrent.delta_rule`.

**allow_neg_eigval** (OLMo-Hybrid's option, and fla's): ``beta = 2·sigmoid(b)`` in (0, 2), so the
transition ``exp(g)(I - beta k kᵀ)`` has the eigenvalue ``exp(g)(1 - beta)`` along k, negative for
beta > 1 (with ``|k| = 1`` still inside (-1, 1): the state stays bounded). Its derivative:
``d beta / d b = beta (1 - beta / 2)`` (``beta (1 - beta)`` without it).

**Decoding.** ``new_state(batch)`` holds the convolution's last ``K - 1`` inputs and the
delta-rule state ``S (B, Hv, Dk, Dv)`` (transformers' layout); ``forward(x_new, state=state)``
continues the sequence. A backward after a forward with a state treats that state as a constant.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import recurrent
from ..errors import ShapeError, positive_int
from ..options import parse_flag
from .activations import sigmoid, silu_backward, silu_forward
from .base import Layer, check_input, linear_grad
from .hf_variants import GATED_DELTA_LAYOUTS, gated_delta_settings, gated_delta_widths
from .recurrent_parts import (RecurrentState, check_state, compute_dtype, conv_backward, conv_forward, conv_tail,
                              grad_output, hf_tensors, l2norm_backward, l2norm_forward, load_hf,
                              norm_then_gate_backward, norm_then_gate_forward, rms_backward, rms_forward,
                              softplus)


class GatedDeltaNet(Layer):
    """Gated DeltaNet with ``n_k_heads`` key heads of ``d_k`` and ``n_v_heads`` value heads of ``d_v``;
    ``allow_neg_eigval``: beta = 2·sigmoid(b) (OLMo-Hybrid's), else sigmoid(b). ``use_gate``: the
    output gate ``silu(z)`` (default); False drops it and its ``Hv·Dv`` columns of ``W_in`` (fla's).

    Parameters (``x @ W``, no biases, as Qwen3-Next; ``C = 2·Hk·Dk + Hv·Dv``)::

        W_in (d_model, 2·Hk·Dk + 2·Hv·Dv + 2·Hv)   conv_weight (C, K)   (Hv·Dv fewer: use_gate=False)
        dt_bias (Hv,)  A_log (Hv,)  norm_weight (Dv,)  W_out (Hv·Dv, d_model)

    Initial decay: ``A = exp(A_log)`` uniform in [1, 16] and ``softplus(dt_bias) = Δ`` log-uniform
    in [1e-3, 0.1] (Mamba's time-step init, which the Gated DeltaNet paper's code uses), so a
    step keeps ``exp(-A Δ)`` of the state, 0.2 to 0.999. transformers' ``dt_bias = 1`` (Δ = 1.31)
    keeps at most 0.27 and as little as 1e-9: a layer trained from scratch with it forgets
    the previous token, and the gradient that would lengthen its memory vanishes with the decay.
    """

    def __init__(self, d_model: int, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int, *, conv_kernel: int = 4,
                 eps: float = 1e-6, allow_neg_eigval: bool = False, use_gate: bool = True, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        self.n_k_heads, self.n_v_heads = positive_int("n_k_heads", n_k_heads), positive_int("n_v_heads", n_v_heads)
        self.d_k, self.d_v = positive_int("d_k", d_k), positive_int("d_v", d_v)
        if self.n_v_heads % self.n_k_heads:
            raise ShapeError(f"n_v_heads must be a multiple of n_k_heads; got n_v_heads = {n_v_heads}, "
                             f"n_k_heads = {n_k_heads}")
        self.conv_kernel, self.eps = positive_int("conv_kernel", conv_kernel), float(eps)
        self.allow_neg_eigval = parse_flag("allow_neg_eigval", allow_neg_eigval)
        self.use_gate = parse_flag("use_gate", use_gate)
        Hv = self.n_v_heads
        self._add("W_in", (self.d_model, sum(self._widths)))
        self._add("conv_weight", (self.conv_dim, self.conv_kernel), std=1 / math.sqrt(self.conv_kernel))
        a_log = np.log(self.rng.uniform(1.0, 16.0, Hv))
        dt = np.exp(self.rng.uniform(math.log(1e-3), math.log(0.1), Hv))  # Mamba's Δ init, as the paper's code
        for name, value in (("dt_bias", dt + np.log(-np.expm1(-dt))), ("A_log", a_log),
                            ("norm_weight", np.ones(self.d_v))):
            self._add(name, value.shape, zero=True)
            self.params[name][...] = value
        self._add("W_out", (Hv * self.d_v, self.d_model))

    @property
    def _widths(self) -> list[int]:
        """Widths of ``q, k, v, z, b, a`` in ``W_in``'s columns (z: 0 without the gate)."""
        widths = gated_delta_widths(self.n_k_heads, self.n_v_heads, self.d_k, self.d_v)
        if not self.use_gate:
            widths["z"] = 0
        return list(widths.values())

    @property
    def beta_max(self) -> float:
        """beta's upper bound: 2 with ``allow_neg_eigval``, else 1."""
        return 2.0 if self.allow_neg_eigval else 1.0

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v

    @property
    def _cd(self) -> np.dtype:
        return compute_dtype(self.dtype)

    def _p(self, name):
        return self.params[name].astype(self._cd, copy=False)

    def new_state(self, batch: int) -> RecurrentState:
        """An empty :class:`~qkv.nn.RecurrentState`: conv ``(B, K-1, C)``, recurrent ``(B, Hv, Dk, Dv)``."""
        b = positive_int("batch", batch)
        return RecurrentState((b, self.conv_kernel - 1, self.conv_dim),
                              (b, self.n_v_heads, self.d_k, self.d_v), self._cd)

    # --- forward / backward --------------------------------------------------------------------
    def _heads(self, flat: np.ndarray, heads: int) -> np.ndarray:
        """``(B, T, heads·D) -> (B, heads, T, D)``."""
        B, T, w = flat.shape
        return flat.reshape(B, T, heads, w // heads).transpose(0, 2, 1, 3)

    def forward(self, x, *, state: RecurrentState | None = None) -> np.ndarray:
        """``x (B, T, d_model)`` (or ``(T, d_model)``) -> ``(B, T, d_model)``; ``state`` continues a sequence."""
        x3, squeezed = check_input("x", x, self.d_model, empty=True)
        x3 = x3.astype(self._cd, copy=False)
        Bsz, T, _ = x3.shape
        check_state(self, state, Bsz)
        Hk, Hv = self.n_k_heads, self.n_v_heads
        proj = (x3.reshape(-1, self.d_model) @ self._p("W_in")).reshape(Bsz, T, self.params["W_in"].shape[1])  # (BT,d) @ (d,W) -> (B,T,W)
        ends = np.cumsum(self._widths)
        qkv, z, b, a = proj[..., :ends[2]], proj[..., ends[2]:ends[3]], proj[..., ends[3]:ends[4]], proj[..., ends[4]:]
        prefix = None if state is None else state.conv.copy()
        conv, padded = conv_forward(qkv, self._p("conv_weight"), None, prefix)
        act, silu_saved = silu_forward(conv)                                   # (B, T, C)
        qn, rq = l2norm_forward(self._heads(act[..., :ends[0]], Hk))           # (B, Hk, T, Dk)
        kn, rk = l2norm_forward(self._heads(act[..., ends[0]:ends[1]], Hk))    # (B, Hk, T, Dk)
        v = self._heads(act[..., ends[1]:], Hv)                                 # (B, Hv, T, Dv)
        q, k = qn, kn                           # (B, Hk, T, Dk): value head h reads key head h // r (delta_rule)
        beta = sigmoid(b).transpose(0, 2, 1)                                   # (B, Hv, T)
        if self.allow_neg_eigval:
            beta = 2 * beta                                                    # in (0, 2)
        raw = a + self._p("dt_bias")
        neg_a = -np.exp(self._p("A_log"))
        g = (neg_a * softplus(raw)).transpose(0, 2, 1)                          # (B, Hv, T)
        s0 = None if state is None else state.recurrent.copy()
        o, s_T = recurrent.delta_rule(q, k, v, beta, g, scale=1 / math.sqrt(self.d_k), initial_state=s0,
                                      return_state=True)                       # (B, Hv, T, Dv)
        if self.use_gate:
            zh = z.reshape(Bsz, T, Hv, self.d_v)
            normed, norm_saved = norm_then_gate_forward(o.transpose(0, 2, 1, 3), zh, self._p("norm_weight"), self.eps)
        else:                                                                  # norm_w ∘ rms(o), no gate
            norm_saved = rms_forward(o.transpose(0, 2, 1, 3), self.eps)        # (ô, r), (B, T, Hv, Dv)
            normed = self._p("norm_weight") * norm_saved[0]
        flat = normed.reshape(Bsz, T, Hv * self.d_v)
        out = (flat.reshape(Bsz * T, Hv * self.d_v) @ self._p("W_out")).reshape(Bsz, T, self.d_model)  # (BT,HvDv) @ (HvDv,d)
        if state is not None:
            state.conv[...] = conv_tail(padded, self.conv_kernel)
            state.recurrent[...] = s_T
            state.length += T
        self._keep(dict(x=x3, padded=padded, silu=silu_saved, qn=qn, rq=rq, kn=kn, rk=rk, q=q, k=k, v=v, beta=beta,
                        raw=raw, neg_a=neg_a, g=g, s0=s0, norm=norm_saved, flat=flat, squeezed=squeezed))
        out = out.astype(self.dtype, copy=False)
        return out[0] if squeezed else out

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy`` (the output's shape); return ``dx``."""
        s = self._need_saved()
        x3 = s["x"]
        Bsz, T, _ = x3.shape
        Hk, Hv = self.n_k_heads, self.n_v_heads
        dy = grad_output(dy, x3.shape, s["squeezed"]).astype(self._cd, copy=False)
        self.grads["W_out"][...] = linear_grad(s["flat"], dy)
        dflat = (dy.reshape(Bsz * T, self.d_model) @ self._p("W_out").T).reshape(Bsz, T, Hv, self.d_v)  # (BT,d) @ (d,HvDv)
        if self.use_gate:
            do, dz, self.grads["norm_weight"][...] = norm_then_gate_backward(dflat, s["norm"], self._p("norm_weight"))
        else:
            ohat, rinv = s["norm"]
            self.grads["norm_weight"][...] = (dflat * ohat).reshape(-1, self.d_v).sum(axis=0)
            do, dz = rms_backward(dflat * self._p("norm_weight"), ohat, rinv), dflat[..., :0]
        dq, dk, dv, dbeta, dg, _ = recurrent.delta_rule_backward(
            do.transpose(0, 2, 1, 3), s["q"], s["k"], s["v"], s["beta"], s["g"], scale=1 / math.sqrt(self.d_k),
            initial_state=s["s0"])                                             # dq, dk: each key head's r summed
        ends = np.cumsum(self._widths)
        dact = np.empty((Bsz, T, ends[2]), dtype=dq.dtype)                     # [dq | dk | dv], heads written in place
        l2norm_backward(dq, s["qn"], s["rq"], out=self._heads(dact[..., :ends[0]], Hk))
        l2norm_backward(dk, s["kn"], s["rk"], out=self._heads(dact[..., ends[0]:ends[1]], Hk))
        self._heads(dact[..., ends[1]:], Hv)[...] = dv
        dqkv, self.grads["conv_weight"][...], _ = conv_backward(silu_backward(dact, s["silu"]), s["padded"],
                                                                self._p("conv_weight"))
        db = (dbeta * s["beta"] * (1 - s["beta"] / self.beta_max)).transpose(0, 2, 1)  # (B, T, Hv)
        dgt = dg.transpose(0, 2, 1)                                            # (B, T, Hv)
        self.grads["A_log"][...] = np.einsum("bth,bth->h", dgt, s["g"].transpose(0, 2, 1))  # dg/dA_log = g
        da = dgt * s["neg_a"] * sigmoid(s["raw"])
        self.grads["dt_bias"][...] = da.sum(axis=(0, 1))
        dproj = np.concatenate([dqkv, dz.reshape(Bsz, T, dz.shape[2] * dz.shape[3]), db, da], axis=-1)  # (B, T, W)
        self.grads["W_in"][...] = linear_grad(x3, dproj)
        dx = (dproj.reshape(Bsz * T, dproj.shape[-1]) @ self._p("W_in").T).reshape(x3.shape).astype(self.dtype, copy=False)
        return dx[0] if s["squeezed"] else dx

    # --- transformers --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, module, *, dtype=np.float32) -> GatedDeltaNet:
        """The layer of a transformers Gated DeltaNet (Qwen3-Next's, Qwen3.5's, Qwen3.5-MoE's or
        OLMo-Hybrid's, known by its weights: :func:`qkv.nn.hf_variants.gated_delta_settings`),
        weight for weight (shapes checked); a setting the layer does not compute is refused by name."""
        where = "GatedDeltaNet.from_hf"
        settings = gated_delta_settings(module, where)
        lay = GATED_DELTA_LAYOUTS[settings.pop("layout")]
        t = hf_tensors(module, where, "Gated DeltaNet layer", ())
        layer = cls(**settings, dtype=dtype)
        w_in = functools.cache(lambda: (_interleaved_w_in if lay.interleaved else _stacked_w_in)(layer, lay, t))
        table = {f"{name}.weight": ("W_in", lambda _: w_in()) for name, _ in lay.projections}
        table.update({"conv1d.weight": ("conv_weight", lambda w: w[:, 0, :]), "dt_bias": ("dt_bias", lambda a: a),
                      "A_log": ("A_log", lambda a: a), f"{lay.norm}.weight": ("norm_weight", lambda a: a),
                      f"{lay.out}.weight": ("W_out", np.transpose)})
        load_hf(layer, t, table, where)
        return layer


def _interleaved_w_in(layer: GatedDeltaNet, lay, t: dict) -> np.ndarray:
    """Qwen3-Next's per-key-head interleaving -> ``W_in (d_model, W)``, columns ``[q | k | v | z | b | a]``."""
    Hk, r, Dk, Dv, d = layer.n_k_heads, layer.n_v_heads // layer.n_k_heads, layer.d_k, layer.d_v, layer.d_model
    qkvz, ba = (t[f"{name}.weight"] for name, _ in lay.projections)
    if qkvz.shape != (Hk * (2 * Dk + 2 * r * Dv), d) or ba.shape != (Hk * 2 * r, d):
        return np.zeros((0, 0))  # load_hf names the shapes
    per = qkvz.reshape(Hk, 2 * Dk + 2 * r * Dv, d)                      # (Hk, rows of one key head, d)
    parts = np.split(per, np.cumsum([Dk, Dk, r * Dv]), axis=1)          # q, k, v, z of each key head
    bas = np.split(ba.reshape(Hk, 2 * r, d), [r], axis=1)               # b, a of each key head
    return np.concatenate([p.reshape(-1, d) for p in parts + bas], axis=0).T


def _stacked_w_in(layer: GatedDeltaNet, lay, t: dict) -> np.ndarray:
    """Projections that hold whole parts in order (Qwen3.5's ``in_proj_qkv`` = ``[q | k | v]``,
    OLMo-Hybrid's one part each) -> ``W_in (d_model, W)``, columns ``[q | k | v | z | b | a]``."""
    widths = gated_delta_widths(layer.n_k_heads, layer.n_v_heads, layer.d_k, layer.d_v)
    blocks = {}
    for name, parts in lay.projections:
        w = t[f"{name}.weight"]                                                # (rows, d_model)
        sizes = [widths[p] for p in parts]
        if w.shape != (sum(sizes), layer.d_model):
            return np.zeros((0, 0))  # load_hf names the shapes
        blocks.update(zip(parts, np.split(w, np.cumsum(sizes)[:-1], axis=0)))
    return np.concatenate([blocks[p] for p in "qkvzba"], axis=0).T
