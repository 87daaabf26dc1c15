"""The transformer's feed-forward: ``x -> act(x W_fc + b_fc) W_proj + b_proj`` (or SwiGLU).

GELU (``activation="gelu"``, the exact one, BERT's) or its tanh approximation
(``"gelu_tanh"``, GPT-2's)::

    h = x W_fc + b_fc          (..., d_model) @ (d_model, d_hidden) -> (..., d_hidden)
    a = act(h)
    y = a W_proj + b_proj      (..., d_hidden) @ (d_hidden, d_model) -> (..., d_model)

SwiGLU (``"swiglu"``, Shazeer 2020; Llama's feed-forward) gates one projection with another::

    a = silu(x W_gate + b_gate) ∘ (x W_fc + b_fc)
    y = a W_proj + b_proj

Backward reverses it: ``da = dy W_projᵀ`` (and ``dW_proj = aᵀ dy``), ``dh = act'(h) ∘ da``
(SwiGLU: ``d(up) = silu(g) ∘ da``, ``d(g) = silu'(g) ∘ up ∘ da``), ``dx = dh W_fcᵀ (+ dg W_gateᵀ)``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int
from .activations import ACTIVATIONS, silu_backward, silu_forward
from .base import Layer
from .layers import Linear

MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


class MLP(Layer):
    """Feed-forward of width ``d_hidden`` (default ``4 * d_model``) on ``x (..., d_model)``.

    Parameters (``x @ W + b``, each an :class:`~qkv.nn.Linear`: ``fc``, ``gate`` for SwiGLU,
    ``proj``)::

        W_fc   (d_model, d_hidden)   b_fc   (d_hidden,)
        W_gate (d_model, d_hidden)   b_gate (d_hidden,)     SwiGLU only
        W_proj (d_hidden, d_model)   b_proj (d_model,)      biases only with bias=True
    """

    def __init__(self, d_model: int, d_hidden: int | None = None, activation: str = "gelu", bias: bool = True,
                 *, dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        if activation not in MLP_ACTIVATIONS:
            raise ShapeError(f"activation must be one of {list(MLP_ACTIVATIONS)}; got {activation!r}")
        self.d_model = positive_int("d_model", d_model)
        self.d_hidden = 4 * self.d_model if d_hidden is None else positive_int("d_hidden", d_hidden)
        self.activation, self.bias = activation, bool(bias)
        d, f = self.d_model, self.d_hidden
        self.fc = Linear(d, f, bias=self.bias, dtype=self.dtype, rng=self.rng)
        self.gate = Linear(d, f, bias=self.bias, dtype=self.dtype, rng=self.rng) if activation == "swiglu" else None
        self.proj = Linear(f, d, bias=self.bias, dtype=self.dtype, rng=self.rng)
        named = [("fc", self.fc), ("gate", self.gate), ("proj", self.proj)]
        links = {f"W_{n}": (layer, "W") for n, layer in named if layer is not None}
        if self.bias:
            links.update({f"b_{n}": (layer, "b") for n, layer in named if layer is not None})
        self._expose(links)

    def forward(self, x) -> np.ndarray:
        """``(..., d_model) -> (..., d_model)``."""
        h = self.fc.forward(x)                     # (..., d_model) @ (d_model, d_hidden) -> (..., d_hidden)
        if self.activation == "swiglu":
            s, silu_saved = silu_forward(self.gate.forward(x))  # silu(x W_gate + b_gate)
            a = s * h
            saved = (s, h, silu_saved)
        else:
            a, saved = ACTIVATIONS[self.activation][0](h)
        self._keep(saved)
        return self.proj.forward(a)                # (..., d_hidden) @ (d_hidden, d_model) -> (..., d_model)

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (..., d_model)``; return ``dx (..., d_model)``."""
        saved = self._need_saved()
        da = self.proj.backward(dy)                # (..., d_model) @ (d_model, d_hidden) -> (..., d_hidden)
        if self.activation == "swiglu":
            s, h, silu_saved = saved
            dx = self.fc.backward(s * da)          # d(up) = silu(g) ∘ da
            return dx + self.gate.backward(silu_backward(h * da, silu_saved))  # d(g) = silu'(g) ∘ up ∘ da
        dh = ACTIVATIONS[self.activation][1](da, saved)
        return self.fc.backward(dh)                # (..., d_hidden) @ (d_hidden, d_model) -> (..., d_model)
