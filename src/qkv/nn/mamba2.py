"""Mamba-2's block (the mixer of transformers' ``Mamba2Mixer``) as a trainable NumPy layer.

Forward, for ``x (B, T, d_model)``, ``H`` heads of width ``P`` (``I = H·P``), ``G`` groups of
``N``-wide B and C (heads ``h·H/G .. (h+1)·H/G - 1`` share group h)::

    [z | xBC | dt] = x W_in + b_in                          (B, T, I), (B, T, I + 2GN), (B, T, H)
    [xs | Bm | Cm] = silu(conv(xBC))                        short causal depthwise conv, K taps
    Δ  = clamp(softplus(dt + dt_bias), dt_limit)           (B, T, H)
    A  = -exp(A_log)                                        (H,)
    S_t = exp(Δ_t A) S_{t-1} + Bm_t (Δ_t xs_t)ᵀ             per head: S (N, P)
    y_t = S_tᵀ Cm_t + D ∘ xs_t                              SSD = decay_attention(q=Cm, k=Bm, v=Δ·xs,
                                                                  log_decay=Δ·A, scale=1)
    out = (norm_w ∘ rms_G(y ∘ silu(z))) W_out + b_out        the gated RMSNorm over G groups of I

``norm`` names the gate's place: ``"gate_then_norm"`` above (Mamba-2's), ``"norm_then_gate"``
``(norm_w ∘ rms_G(y)) ∘ silu(z)`` (Falcon-H1's default) or ``"none"``, ``y ∘ silu(z)`` (Falcon-H1
without its RMSNorm). Falcon-H1's µP multipliers are ``in_multiplier`` (x times it before W_in)
and ``proj_scale`` (the projection, bias included, times one constant a column); neither is
trained. :mod:`qkv.nn.hf_variants` reads them off a transformers mixer.

The recurrence is :func:`qkv.recurrent.decay_attention` and its backward; the rest is written
out below, each backward step beside its forward in reverse.

**Decoding.** ``new_state(batch)`` holds the convolution's last ``K - 1`` inputs and the SSD
state ``S (B, H, N, P)`` (transformers keeps its transpose, ``(B, H, P, N)``);
``forward(x_new, state=state)`` continues the sequence and updates the state, so a prefill
and then one token at a time gives the whole sequence's output. A backward after a forward
with a state treats the state it started from as a constant.
"""
from __future__ import annotations

import math

import numpy as np

from .. import recurrent
from ..errors import OptionError, ShapeError, positive_int
from .activations import sigmoid, silu_backward, silu_forward
from .base import Layer, check_input, linear_grad
from .hf_variants import NORMS, mamba2_settings
from .recurrent_parts import (RecurrentState, check_state, compute_dtype, conv_backward, conv_forward, conv_tail,
                              gate_then_norm_backward, gate_then_norm_forward, grad_output, hf_tensors, load_hf,
                              norm_then_gate_backward, norm_then_gate_forward, softplus)


class Mamba2(Layer):
    """Mamba-2's mixer: ``n_heads`` heads of ``head_dim``, SSD state ``state_size``, ``n_groups``.

    Parameters (projections are ``x @ W + b``; ``C = n_heads·head_dim + 2·n_groups·state_size``)::

        W_in (d_model, I + C + H)   b_in (I + C + H,)    with bias=True
        conv_weight (C, K)          conv_bias (C,)       with conv_bias=True
        dt_bias (H,)  A_log (H,)  D (H,)  norm_weight (I,)
        W_out (I, d_model)          b_out (d_model,)     with out_bias (None: as bias)

    ``dt_limit``: Δ is clamped to ``[lo, hi]`` (transformers' ``time_step_limit``). ``norm``,
    ``in_multiplier``, ``proj_scale``: the module docstring (no norm_weight with ``norm="none"``).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, state_size: int, *, n_groups: int = 1,
                 conv_kernel: int = 4, bias: bool = False, conv_bias: bool = True, eps: float = 1e-5,
                 dt_limit=(0.0, math.inf), out_bias: bool | None = None, norm: str = "gate_then_norm",
                 in_multiplier: float = 1.0, proj_scale=None, dtype=np.float32,
                 rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model, self.n_heads = positive_int("d_model", d_model), positive_int("n_heads", n_heads)
        self.head_dim, self.state_size = positive_int("head_dim", head_dim), positive_int("state_size", state_size)
        self.n_groups, self.conv_kernel = positive_int("n_groups", n_groups), positive_int("conv_kernel", conv_kernel)
        if self.n_heads % self.n_groups:
            raise ShapeError(f"n_heads must be a multiple of n_groups; got n_heads = {n_heads}, n_groups = {n_groups}")
        self.bias, self.conv_bias, self.eps = bool(bias), bool(conv_bias), float(eps)
        lo, hi = (float(v) for v in dt_limit)
        if not 0 <= lo <= hi:
            raise ShapeError(f"dt_limit must be (lo, hi) with 0 <= lo <= hi; got {dt_limit!r}")
        self.dt_limit = (lo, hi)
        H, I, C = self.n_heads, self.d_inner, self.conv_dim
        self.out_bias = self.bias if out_bias is None else bool(out_bias)
        if norm not in NORMS:
            raise OptionError(f"norm must be one of {NORMS}; got {norm!r}")
        self.norm = norm
        self.in_multiplier = float(in_multiplier)
        if not math.isfinite(self.in_multiplier):
            raise OptionError(f"in_multiplier must be a finite number; got {in_multiplier!r}")
        if proj_scale is not None:
            proj_scale = np.array(proj_scale, dtype=np.float64)
            if proj_scale.shape != (I + C + H,) or not np.isfinite(proj_scale).all():
                raise ShapeError(f"proj_scale must be None or finite of shape (I + C + H,) = ({I + C + H},); "
                                 f"got {proj_scale.shape}")
        self.proj_scale = proj_scale
        self._add("W_in", (self.d_model, I + C + H))
        if self.bias:
            self._add("b_in", (I + C + H,), zero=True)
        self._add("conv_weight", (C, self.conv_kernel), std=1 / math.sqrt(self.conv_kernel))
        if self.conv_bias:
            self._add("conv_bias", (C,), zero=True)
        dt = np.exp(self.rng.uniform(math.log(1e-3), math.log(0.1), H))   # transformers' init
        for name, value in (("dt_bias", dt + np.log(-np.expm1(-dt))), ("A_log", np.log(np.arange(1, H + 1))),
                            ("D", np.ones(H)), ("norm_weight", np.ones(I))):
            if name == "norm_weight" and norm == "none":
                continue
            self._add(name, value.shape, zero=True)
            self.params[name][...] = value
        self._add("W_out", (I, self.d_model))
        if self.out_bias:
            self._add("b_out", (self.d_model,), zero=True)

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    # --- state ---------------------------------------------------------------------------------
    def new_state(self, batch: int) -> RecurrentState:
        """An empty :class:`~qkv.nn.RecurrentState`: conv ``(B, K-1, C)``, recurrent ``(B, H, N, P)``."""
        b = positive_int("batch", batch)
        return RecurrentState((b, self.conv_kernel - 1, self.conv_dim),
                              (b, self.n_heads, self.state_size, self.head_dim), compute_dtype(self.dtype))

    # --- forward / backward --------------------------------------------------------------------
    def _p(self, name):
        p = self.params.get(name)
        return None if p is None else p.astype(self._cd, copy=False)

    @property
    def _cd(self) -> np.dtype:
        return compute_dtype(self.dtype)

    def forward(self, x, *, state: RecurrentState | None = None) -> np.ndarray:
        """``x (B, T, d_model)`` (or ``(T, d_model)``) -> ``(B, T, d_model)``; ``state`` continues a sequence."""
        x3, squeezed = check_input("x", x, self.d_model, empty=True)
        x3 = x3.astype(self._cd, copy=False)
        Bsz, T, _ = x3.shape
        check_state(self, state, Bsz)
        H, P, G, N, I = self.n_heads, self.head_dim, self.n_groups, self.state_size, self.d_inner
        xin = x3 * self.in_multiplier if self.in_multiplier != 1.0 else x3
        proj = xin.reshape(-1, self.d_model) @ self._p("W_in")                # (BT,d) @ (d,I+C+H) -> (BT,I+C+H)
        if self.bias:
            proj += self._p("b_in")
        if self.proj_scale is not None:
            proj *= self.proj_scale.astype(self._cd)
        proj = proj.reshape(Bsz, T, proj.shape[-1])
        z, xbc, dt = proj[..., :I], proj[..., I:I + self.conv_dim], proj[..., I + self.conv_dim:]
        prefix = None if state is None else state.conv.copy()
        conv, padded = conv_forward(xbc, self._p("conv_weight"), self._p("conv_bias"), prefix)
        act, silu_saved = silu_forward(conv)                                   # (B, T, C)
        xs, Bm, Cm = act[..., :I], act[..., I:I + G * N], act[..., I + G * N:]
        raw = dt + self._p("dt_bias")
        delta = np.clip(softplus(raw), *self.dt_limit)                          # (B, T, H)
        A = -np.exp(self._p("A_log"))
        xh = xs.reshape(Bsz, T, H, P).transpose(0, 2, 1, 3)                    # (B, H, T, P)
        q = np.repeat(Cm.reshape(Bsz, T, G, N).transpose(0, 2, 1, 3), H // G, axis=1)   # (B, H, T, N)
        k = np.repeat(Bm.reshape(Bsz, T, G, N).transpose(0, 2, 1, 3), H // G, axis=1)   # (B, H, T, N)
        dth = delta.transpose(0, 2, 1)                                          # (B, H, T)
        v = xh * dth[..., None]                                                # (B, H, T, P)
        g = dth * A[:, None]                                                   # (B, H, T)
        s0 = None if state is None else state.recurrent.copy()
        o, s_T = recurrent.decay_attention(q, k, v, g, scale=1.0, initial_state=s0, return_state=True)
        y = o + self._p("D")[:, None, None] * xh                              # (B, H, T, P)
        y = y.transpose(0, 2, 1, 3).reshape(Bsz, T, I)
        normed, norm_saved = self._norm_forward(y, z)
        out = normed.reshape(-1, I) @ self._p("W_out")                         # (BT,I) @ (I,d) -> (BT,d)
        if self.out_bias:
            out += self._p("b_out")
        if state is not None:
            state.conv[...] = conv_tail(padded, self.conv_kernel)
            state.recurrent[...] = s_T
            state.length += T
        self._keep(dict(x=xin, padded=padded, silu=silu_saved, raw=raw, delta=delta, A=A, xh=xh, q=q, k=k, v=v,
                        g=g, s0=s0, norm=norm_saved, normed=normed, squeezed=squeezed))
        out = out.reshape(Bsz, T, self.d_model).astype(self.dtype, copy=False)
        return out[0] if squeezed else out

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy`` (the output's shape); return ``dx``."""
        s = self._need_saved()
        x3 = s["x"]
        Bsz, T, _ = x3.shape
        H, P, G, N, I = self.n_heads, self.head_dim, self.n_groups, self.state_size, self.d_inner
        dy = grad_output(dy, x3.shape, s["squeezed"]).astype(self._cd, copy=False)
        dflat = dy.reshape(-1, self.d_model)
        self.grads["W_out"][...] = linear_grad(s["normed"], dy)
        if self.out_bias:
            self.grads["b_out"][...] = dflat.sum(axis=0)
        dnormed = (dflat @ self._p("W_out").T).reshape(Bsz, T, I)              # (BT,d) @ (d,I) -> (BT,I)
        dyo, dz = self._norm_backward(dnormed, s["norm"])
        dyo = dyo.reshape(Bsz, T, H, P).transpose(0, 2, 1, 3)                  # (B, H, T, P)
        self.grads["D"][...] = np.einsum("bhtp,bhtp->h", dyo, s["xh"])
        dq, dk, dv, dg, _ = recurrent.decay_attention_backward(dyo, s["q"], s["k"], s["v"], s["g"], scale=1.0,
                                                               initial_state=s["s0"])
        dth = s["delta"].transpose(0, 2, 1)                                    # (B, H, T)
        dxh = dyo * self._p("D")[:, None, None] + dv * dth[..., None]
        ddelta = np.einsum("bhtp,bhtp->bht", dv, s["xh"]) + dg * s["A"][:, None]
        self.grads["A_log"][...] = np.einsum("bht,bht->h", dg, dth) * s["A"]   # dA/dA_log = A
        ddelta = ddelta.transpose(0, 2, 1)                                     # (B, T, H)
        lo, hi = self.dt_limit
        sp = softplus(s["raw"])
        draw = ddelta * ((sp >= lo) & (sp <= hi)) * sigmoid(s["raw"])
        self.grads["dt_bias"][...] = draw.sum(axis=(0, 1))
        dact = np.empty((Bsz, T, I + 2 * G * N), dtype=dxh.dtype)              # [dx | dB | dC], heads in place
        for part, (lo, n) in ((dxh, (0, H)), (_group_sum(dk, G), (I, G)), (_group_sum(dq, G), (I + G * N, G))):
            width = part.shape[-1] * n
            dact[..., lo:lo + width].reshape(Bsz, T, n, part.shape[-1])[...] = part.transpose(0, 2, 1, 3)
        dxbc, self.grads["conv_weight"][...], dcb = conv_backward(silu_backward(dact, s["silu"]), s["padded"],
                                                                 self._p("conv_weight"))
        if self.conv_bias:
            self.grads["conv_bias"][...] = dcb
        dproj = np.concatenate([dz, dxbc, draw], axis=-1)                      # (B, T, I+C+H)
        if self.proj_scale is not None:
            dproj *= self.proj_scale.astype(self._cd)
        self.grads["W_in"][...] = linear_grad(x3, dproj)                       # x3: x · in_multiplier
        if self.bias:
            self.grads["b_in"][...] = dproj.reshape(-1, dproj.shape[-1]).sum(axis=0)
        dx = (dproj.reshape(Bsz * T, dproj.shape[-1]) @ self._p("W_in").T).reshape(x3.shape)  # (BT,I+C+H) @ (I+C+H,d)
        if self.in_multiplier != 1.0:
            dx *= self.in_multiplier
        dx = dx.astype(self.dtype, copy=False)
        return dx[0] if s["squeezed"] else dx

    def _norm_forward(self, y, z):
        """``(normed, saved)`` of the gated norm ``self.norm`` on ``y, z (B, T, I)``."""
        if self.norm == "gate_then_norm":
            return gate_then_norm_forward(y, z, self._p("norm_weight"), self.n_groups, self.eps)
        if self.norm == "none":
            sz, silu_saved = silu_forward(z)
            return y * sz, (y, sz, silu_saved)
        split = y.shape[:-1] + (self.n_groups, self.d_inner // self.n_groups)  # (B, T, G, I/G)
        w = self._p("norm_weight").reshape(split[-2:])
        out, saved = norm_then_gate_forward(y.reshape(split), z.reshape(split), w, self.eps)
        return out.reshape(y.shape), saved

    def _norm_backward(self, dout, saved):
        """``(dy, dz)`` of :meth:`_norm_forward`; fills ``grads["norm_weight"]``."""
        if self.norm == "gate_then_norm":
            dy, dz, self.grads["norm_weight"][...] = gate_then_norm_backward(dout, saved, self._p("norm_weight"))
            return dy, dz
        if self.norm == "none":
            y, sz, silu_saved = saved
            return dout * sz, silu_backward(dout * y, silu_saved)
        yhat, sz = saved[0], saved[3]
        dg = dout.reshape(yhat.shape)                                          # (B, T, G, I/G)
        w = self._p("norm_weight").reshape(yhat.shape[-2:])
        dy, dz, _ = norm_then_gate_backward(dg, saved, w)
        self.grads["norm_weight"][...] = (dg * sz * yhat).sum(axis=(0, 1)).reshape(-1)
        return dy.reshape(dout.shape), dz.reshape(dout.shape)

    # --- transformers --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, module, *, dtype=np.float32) -> Mamba2:
        """The layer of a transformers Mamba-2 mixer (``Mamba2Mixer``, and Bamba's, Nemotron-H's,
        Zamba-2's, Granite's and Falcon-H1's with its norm variants and µP multipliers), weight for
        weight (shapes checked); a setting it does not compute is refused by name
        (:func:`qkv.nn.hf_variants.mamba2_settings`)."""
        settings = mamba2_settings(module, "Mamba2.from_hf")
        t = hf_tensors(module, "Mamba2.from_hf", "Mamba-2 mixer", ())
        layer = cls(**settings, dtype=dtype)
        same = lambda a: a  # noqa: E731
        table = {"in_proj.weight": ("W_in", np.transpose), "out_proj.weight": ("W_out", np.transpose),
                 "conv1d.weight": ("conv_weight", lambda w: w[:, 0, :]), "dt_bias": ("dt_bias", same),
                 "A_log": ("A_log", same), "D": ("D", same)}
        if layer.norm != "none":
            table["norm.weight"] = ("norm_weight", same)
        if layer.bias:
            table["in_proj.bias"] = ("b_in", same)
        if layer.out_bias:
            table["out_proj.bias"] = ("b_out", same)
        if layer.conv_bias:
            table["conv1d.bias"] = ("conv_bias", same)
        load_hf(layer, t, table, "Mamba2.from_hf")
        return layer

def _group_sum(d: np.ndarray, groups: int) -> np.ndarray:
    """``(B, H, T, N) -> (B, G, T, N)``: the gradient of repeating each group over its H/G heads."""
    B, H, T, N = d.shape
    return d.reshape(B, groups, H // groups, T, N).sum(axis=2)
