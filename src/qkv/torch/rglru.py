"""Griffin's recurrent block (RecurrentGemma, Hawk) as an ``nn.Module`` on qkv's scan.

transformers' ``RecurrentGemmaRecurrentBlock``, its parameters under the same names::

    y   = act(linear_y(x))                              the gate branch
    u   = conv_1d(linear_x(x))                          causal depthwise convolution
    i_t = sigmoid(u_t W_x + b_x)   r_t = sigmoid(u_t W_a + b_a)   (block-diagonal: one
                                                        (w, w) block a head, w = W / heads)
    log a_t = -8 · r_t · softplus(Λ)                    (Λ: recurrent_param)
    h_t = a_t ∘ h_{t-1} + sqrt(1 - a_t²) ∘ (i_t ∘ u_t)  the RG-LRU: qkv.torch.linear_scan
    out = linear_out(h ∘ y)

At a sequence's first token (position 0, a fresh state) the normaliser ``sqrt(1 - a²)`` is 1
and the state starts at zero, as transformers' ``reset``. The square root's derivative is
capped by default (``1 / sqrt(max(4x, 1 / bound²))`` with ``sqrt_grad_bound=1000``,
transformers' ``SqrtBoundDerivative``) so that ``a → 1`` does not blow up a gradient; where
``1 - a² < 2.5e-7`` that gradient is smaller than the true one. ``sqrt_grad_bound=None``
takes torch's own derivative of ``sqrt`` (the true one; see :mod:`qkv.nn.rglru` and
docs/recurrent-layers.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ShapeError, positive_int
from ..nn.hf_variants import RGLRU_NEEDS, require
from ..nn.rglru import MAX_SQRT_GRADIENT, check_sqrt_grad_bound
from .layer_state import RecurrentState, activation as activation_fn, causal_conv, check_input, check_state, load_hf
from .recurrent_ops import linear_scan


class _SqrtBoundedGrad(torch.autograd.Function):
    """``sqrt(x)``, its derivative ``1 / (2 sqrt(x))`` capped at ``bound``."""

    @staticmethod
    def forward(ctx, x, bound):
        ctx.save_for_backward(x)
        ctx.bound = bound
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * x, min=1.0 / ctx.bound ** 2)), None


def _sqrt(x, bound):
    """``sqrt(x)``; its derivative capped at ``bound``, or torch's own where None."""
    return torch.sqrt(x) if bound is None else _SqrtBoundedGrad.apply(x, bound)


class RealGatedLRU(nn.Module):
    """The RG-LRU's parameters (transformers' ``RecurrentGemmaRglru``): ``recurrent_param (W,)``
    and per head ``(w, w)`` gate weights with ``(w,)`` biases, ``x W + b`` convention."""

    def __init__(self, width: int, n_heads: int, dtype=None, device=None,
                 sqrt_grad_bound: float | None = MAX_SQRT_GRADIENT):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        w = width // n_heads
        self.n_heads = n_heads
        self.sqrt_grad_bound = check_sqrt_grad_bound(sqrt_grad_bound)
        self.recurrent_param = nn.Parameter(torch.empty(width, **kw))
        self.input_gate_weight = nn.Parameter(torch.empty(n_heads, w, w, **kw))
        self.input_gate_bias = nn.Parameter(torch.zeros(n_heads, w, **kw))
        self.recurrent_gate_weight = nn.Parameter(torch.empty(n_heads, w, w, **kw))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(n_heads, w, **kw))
        with torch.no_grad():   # a ∈ (0.9, 0.999) at r = 1 (Griffin's init); gates ~ N(0, 1/w)
            a = torch.empty(width, **kw).uniform_(0.9 ** 2, 0.999 ** 2).sqrt()
            softplus = -torch.log(a) / 8
            self.recurrent_param.copy_(softplus + torch.log(-torch.expm1(-softplus)))   # softplus⁻¹
            for weight in (self.input_gate_weight, self.recurrent_gate_weight):
                weight.normal_(0.0, w ** -0.5)

    def _gate(self, u: torch.Tensor, weight, bias) -> torch.Tensor:
        B, T, W = u.shape
        uh = u.reshape(B, T, self.n_heads, W // self.n_heads)
        return torch.sigmoid(torch.einsum("bthi,hij->bthj", uh, weight) + bias).reshape(B, T, W)  # (B,T,H,w)·(H,w,w)

    def forward(self, u: torch.Tensor, h0: torch.Tensor | None) -> tuple:
        """``(h (B, T, W), h_T (B, W))`` for ``u (B, T, W)`` from ``h0`` (None: a fresh sequence)."""
        i = self._gate(u, self.input_gate_weight, self.input_gate_bias)
        r = self._gate(u, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * r * F.softplus(self.recurrent_param)                    # (B, T, W)
        norm = _sqrt(1 - torch.exp(2 * log_a), self.sqrt_grad_bound)          # sqrt(1 - a²)
        if h0 is None:  # position 0: no normaliser (the state is zero)
            norm = torch.cat([torch.ones_like(norm[:, :1]), norm[:, 1:]], dim=1)
        return linear_scan(u * i * norm, log_a, initial_state=h0, return_state=True)


class RGLRU(nn.Module):
    """Griffin's recurrent block (transformers' ``RecurrentGemmaRecurrentBlock``).

    Args:
        d_model: the width of x. width: the RG-LRU's (``lru_width``). n_heads: its gate blocks
            (divides width). conv_width: the causal convolution's. activation: the gate
            branch's (transformers' ``hidden_activation``). sqrt_grad_bound: transformers'
            bound on the derivative of ``sqrt(1 - a²)`` (1000), or None for the true one.

    ``forward(x (B, T, d_model), state=None, *, return_state=False)``: ``state`` (a
    :class:`RecurrentState`) continues a sequence; None starts one at position 0.
    """

    def __init__(self, d_model: int, width: int, n_heads: int, *, conv_width: int = 4,
                 activation: str = "gelu_pytorch_tanh", dtype=None, device=None,
                 sqrt_grad_bound: float | None = MAX_SQRT_GRADIENT):
        super().__init__()
        for name, v in (("d_model", d_model), ("width", width), ("n_heads", n_heads), ("conv_width", conv_width)):
            positive_int(name, v)
        if width % n_heads:
            raise ShapeError(f"n_heads must divide width = {width}; got {n_heads}")
        self.d_model, self.width, self.n_heads = d_model, width, n_heads
        self.activation, self.act = activation, activation_fn(activation)
        kw = dict(dtype=dtype, device=device)
        self.linear_y = nn.Linear(d_model, width, **kw)
        self.linear_x = nn.Linear(d_model, width, **kw)
        self.linear_out = nn.Linear(width, d_model, **kw)
        self.conv_1d = nn.Conv1d(width, width, conv_width, groups=width, padding=conv_width - 1, **kw)
        self.rg_lru = RealGatedLRU(width, n_heads, sqrt_grad_bound=sqrt_grad_bound, **kw)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, width={self.width}, n_heads={self.n_heads}"

    def forward(self, x, state: RecurrentState | None = None, *, return_state: bool = False):
        """``y (B, T, d_model)``; with ``return_state``, ``(y, state)`` to continue from."""
        check_input(self, x, self.d_model)
        window = check_state(state, x.shape[0], self.conv_1d)
        y = self.act(self.linear_y(x))                                          # (B, T, W)
        u, window = causal_conv(self.linear_x(x), self.conv_1d, window)          # (B, T, W)
        h, final = self.rg_lru(u, None if state is None else state.recurrent)
        out = self.linear_out(h * y)
        return (out, RecurrentState(window, final)) if return_state else out

    @classmethod
    def from_hf(cls, block, *, sqrt_grad_bound: float | None = MAX_SQRT_GRADIENT) -> "RGLRU":
        """This block with the weights of transformers' ``RecurrentGemmaRecurrentBlock``
        (``sqrt_grad_bound`` as in the constructor: transformers' by default)."""
        require(block, "qkv.torch.RGLRU.from_hf", "RecurrentGemmaRecurrentBlock", RGLRU_NEEDS)
        w = block.linear_x.weight
        ours = cls(block.hidden_size, block.lru_width, block.rg_lru.num_attention_heads,
                   conv_width=block.conv1d_width, activation=_hf_activation_name(block.act_fn),
                   dtype=w.dtype, device=w.device, sqrt_grad_bound=sqrt_grad_bound)
        load_hf(ours, block, type(block).__name__)
        return ours


def _hf_activation_name(fn) -> str:
    """The transformers name of an ``ACT2FN`` activation module (``GELUTanh``...)."""
    names = {"PytorchGELUTanh": "gelu_pytorch_tanh", "GELUTanh": "gelu_pytorch_tanh", "GELUActivation": "gelu",
             "SiLUActivation": "silu", "SiLU": "silu", "ReLU": "relu", "GELU": "gelu"}
    name = type(fn).__name__
    if name not in names:
        raise ShapeError(f"the block's activation {name} has no qkv.torch counterpart; known: {sorted(names)}")
    return names[name]
