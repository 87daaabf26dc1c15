"""Zoology's MQAR mixers that are not attention or a named recurrence: a lone BaseConv, and Based.
(The language model around them, Zoology's ``LanguageModel``, is :class:`qkv.models.zoology.ZoologyLM`.)

**ConvMixer** is :class:`~qkv.nn.BaseConv` as a block's mixer of its own (Zoology's 2024 MQAR
models put one BaseConv layer before the mixer under test): ``y = conv(u) ∘ (u W_proj + b_proj) + u``,
its decoding state the last ``K - 1`` inputs.

**BasedAttention** is Based's linear attention (Arora et al. 2024, ``zoology.mixers.based.Based``):
queries and keys projected to ``f`` features a head, the feature map the second-order Taylor
expansion of ``exp`` (Based's ``TaylorExp``)::

    φ(x) = [1, x / f^(1/4), (x ⊗ x) / (√2 · √f)]        1 + f + f² features
    φ(q)·φ(k) = 1 + s + s²/2,   s = q·k / √f           (always >= 1/2: a proper average)
    y_i = Σ_{j<=i} (φ(q_i)·φ(k_j)) v_j / (Σ_{j<=i} φ(q_i)·φ(k_j) + eps)

Its recurrent state is ``(1 + f + f², Dv)`` a head. For the short sequences it trains on it
runs in the parallel form, the weights ``w_ij = 1 + s_ij + s_ij²/2`` made as a ``(T, T)``
array a head (Based's own training path for short sequences), which is the same function.
Backward, with ``Z_i = Σ_j w_ij + eps`` and ``y = (w v) / Z``::

    dN = dy / Z,   dZ_i = -Σ_d dy_id y_id / Z_i,   dw_ij = dN_i·v_j + dZ_i   (j <= i)
    dv = wᵀ dN,    ds = dw ∘ (1 + s),   dq = ds k / √f,   dk = dsᵀ q / √f
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError, positive_int
from .base import Layer, check_input, linear_grad, merge_heads, split_heads
from .recurrent_parts import compute_dtype, grad_output
from .short_conv import BaseConv


class ConvState:
    """A :class:`ConvMixer`'s decoding state: ``window (B, K-1, C)``, the last inputs seen."""

    def __init__(self, batch: int, kernel: int, d_model: int, dtype):
        self.window = np.zeros((positive_int("batch", batch), kernel - 1, d_model), dtype)

    def reset(self) -> None:
        self.window[...] = 0

    @property
    def nbytes(self) -> int:
        return int(self.window.nbytes)


class ConvMixer(BaseConv):
    """:class:`~qkv.nn.BaseConv` as a block's mixer: ``forward(x, *, state=None)``, ``new_state(batch)``."""

    def new_state(self, batch: int) -> ConvState:
        return ConvState(batch, self.kernel, self.d_model, compute_dtype(self.dtype))

    def forward(self, x, *, state: ConvState | None = None) -> np.ndarray:
        return super().forward(x, window=None if state is None else state.window)


class BasedAttention(Layer):
    """Based's causal linear attention with the Taylor feature map (see the module docstring).

    ``n_heads`` heads of ``d_model / n_heads`` values, ``feature_dim`` query/key features a head.
    Parameters, no biases (Based's): ``W_Q, W_K (d_model, n_heads·f)``, ``W_V (d_model, d_model)``,
    ``W_O (d_model, d_model)``, drawn normal(0, 1/sqrt(d_model)).
    """

    def __init__(self, d_model: int, n_heads: int, feature_dim: int = 16, *, eps: float = 1e-12,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model, self.n_heads = positive_int("d_model", d_model), positive_int("n_heads", n_heads)
        self.feature_dim, self.eps = positive_int("feature_dim", feature_dim), float(eps)
        if self.d_model % self.n_heads:
            raise ShapeError(f"d_model must be a multiple of n_heads; got {d_model} and {n_heads}")
        C, F = self.d_model, self.n_heads * self.feature_dim
        for name, shape in (("W_Q", (C, F)), ("W_K", (C, F)), ("W_V", (C, C)), ("W_O", (C, C))):
            self._add(name, shape, zero=True)
            self.params[name][...] = self.rng.standard_normal(shape) / math.sqrt(C)

    def new_state(self, batch: int):
        raise ShapeError("BasedAttention trains and scores whole sequences (its parallel form); it has no "
                         "decoding state, so a model with it cannot generate token by token")

    def _p(self, name: str) -> np.ndarray:
        return self.params[name].astype(compute_dtype(self.dtype), copy=False)

    def forward(self, x, *, state=None) -> np.ndarray:
        """``x (B, T, d_model)`` -> ``(B, T, d_model)``, causal."""
        if state is not None:
            self.new_state(1)
        x3, squeezed = check_input("x", x, self.d_model)
        u = x3.astype(compute_dtype(self.dtype), copy=False)
        H, rf = self.n_heads, 1.0 / math.sqrt(self.feature_dim)
        q = split_heads(u @ self._p("W_Q"), H)                  # (B,T,C) @ (C,H·f) -> (B,H,T,f)
        k = split_heads(u @ self._p("W_K"), H)                  # (B,H,T,f)
        v = split_heads(u @ self._p("W_V"), H)                  # (B,H,T,D)
        T = u.shape[1]
        mask = np.tril(np.ones((T, T), dtype=bool))
        s = (q @ np.swapaxes(k, -1, -2)) * rf                   # (B,H,T,f) @ (B,H,f,T) -> (B,H,T,T)
        w = np.where(mask, 1.0 + s + 0.5 * s * s, 0.0).astype(u.dtype, copy=False)
        z = w.sum(-1) + self.eps                                # (B,H,T)
        o = (w @ v) / z[..., None]                              # (B,H,T,T) @ (B,H,T,D) -> (B,H,T,D)
        om = merge_heads(o)                                     # (B,T,C)
        y = om @ self._p("W_O")                                 # (B,T,C) @ (C,C) -> (B,T,C)
        self._keep(dict(u=u, q=q, k=k, v=v, s=s, w=w, z=z, o=o, om=om, mask=mask, squeezed=squeezed))
        y = y.astype(self.dtype, copy=False)
        return y[0] if squeezed else y

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy`` (the output's shape); return ``dx``."""
        st = self._need_saved()
        u, q, k, v, s, w, z, o = (st[n] for n in ("u", "q", "k", "v", "s", "w", "z", "o"))
        rf = 1.0 / math.sqrt(self.feature_dim)
        dy = grad_output(dy, u.shape, st["squeezed"]).astype(u.dtype, copy=False)
        self.grads["W_O"][...] = linear_grad(st["om"], dy)      # (C,BT) @ (BT,C) -> (C,C)
        do = split_heads(dy @ self._p("W_O").T, self.n_heads)   # (B,T,C) -> (B,H,T,D)
        dn = do / z[..., None]                                  # (B,H,T,D)
        dz = -(do * o).sum(-1) / z                              # (B,H,T)
        dw = np.where(st["mask"], dn @ np.swapaxes(v, -1, -2) + dz[..., None], 0.0)  # (B,H,T,D) @ (B,H,D,T)
        dv = np.swapaxes(w, -1, -2) @ dn                        # (B,H,T,T) @ (B,H,T,D) -> (B,H,T,D)
        ds = (dw * (1.0 + s)).astype(u.dtype, copy=False) * rf  # (B,H,T,T)
        dq = ds @ k                                             # (B,H,T,T) @ (B,H,T,f) -> (B,H,T,f)
        dk = np.swapaxes(ds, -1, -2) @ q                        # (B,H,T,f)
        du = np.zeros_like(u)
        for name, g in (("W_Q", dq), ("W_K", dk), ("W_V", dv)):
            gm = merge_heads(g)                                 # (B,T,H·f) or (B,T,C)
            self.grads[name][...] = linear_grad(u, gm)          # (C,BT) @ (BT,F) -> (C,F)
            du += gm @ self._p(name).T                          # (B,T,F) @ (F,C) -> (B,T,C)
        du = du.astype(self.dtype, copy=False)
        return du[0] if st["squeezed"] else du
