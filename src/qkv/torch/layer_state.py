"""What the recurrent layers (:class:`~qkv.torch.Mamba2`, :class:`~qkv.torch.GatedDeltaNet`,
:class:`~qkv.torch.RGLRU`) share: the decoding state, the causal depthwise convolution that
carries a window of past inputs, activations by their transformers names, and loading a
Hugging Face module's weights.

**The convolution with a window.** Each layer runs a causal depthwise convolution of width
``K`` over time before its recurrence: ``y_t = bias + Σ_{j<K} w_j · x_{t-K+1+j}``, with
``x_s = 0`` for ``s < 0``. Keeping the last ``K-1`` inputs (the window, zeros at the start)
and convolving ``[window, x]`` without padding gives the same ``y`` for a whole sequence, a
prefill, or one token, and the new window is the last ``K-1`` columns of ``[window, x]``; so
prefill-then-step equals the whole sequence by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import OptionError, ShapeError, fmt_shape


@dataclass
class RecurrentState:
    """A batch's decoding state in one recurrent layer: one entry a sequence (row b).

    Attributes:
        conv: ``(B, C, K-1)``, the last ``K-1`` inputs of the layer's causal convolution.
        recurrent: the recurrence's state, ``(B, H, Dk, Dv)`` (Mamba-2: ``Dk`` = the SSM state
            size, ``Dv`` = the head width; Gated DeltaNet: the key and value head widths) or
            the RG-LRU's ``(B, W)``.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    def detach(self) -> "RecurrentState":
        return RecurrentState(self.conv.detach(), self.recurrent.detach())


class NormWeight(nn.Module):
    """A norm's weight ``(n,)`` (ones), kept as a submodule so that its key is transformers'
    (``norm.weight``); the layer applies it."""

    def __init__(self, n: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device))


ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    """The activation a transformers config names (``hidden_act``)."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise OptionError(f"activation must be one of {sorted(ACTIVATIONS)}; got {name!r}") from None


def check_input(layer: nn.Module, x, d_model: int) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != d_model:
        got = fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShapeError(f"x of {type(layer).__name__} must be a tensor of shape (B, T, d_model) with "
                         f"d_model = {d_model}; got {got}")


def check_state(state, batch: int, conv: nn.Conv1d) -> torch.Tensor | None:
    """The state's conv window, after checking it is a :class:`RecurrentState` for this batch
    and convolution (the recurrent part is checked by :mod:`qkv.recurrent`); None for None."""
    if state is None:
        return None
    if not isinstance(state, RecurrentState):
        raise ShapeError(f"state must be a qkv.torch.RecurrentState (or None); got {type(state).__name__}")
    want = (batch, conv.in_channels, conv.kernel_size[0] - 1)
    if tuple(state.conv.shape) != want:
        raise ShapeError(f"state.conv must have shape (B, C, K-1) = {fmt_shape(want)}; "
                         f"got {fmt_shape(state.conv.shape)}")
    return state.conv


def causal_conv(x: torch.Tensor, conv: nn.Conv1d, window: torch.Tensor | None) -> tuple:
    """``(y, new_window)``: the causal depthwise convolution of ``x (B, T, C)`` continuing
    from ``window (B, C, K-1)`` (None: zeros, a fresh sequence), ``y (B, T, C)``."""
    B, T, C = x.shape
    K = conv.kernel_size[0]
    xt = x.transpose(1, 2).to(conv.weight.dtype)               # (B, C, T)
    if window is None:
        window = xt.new_zeros(B, C, K - 1)
    full = torch.cat([window.to(xt.dtype), xt], dim=-1)        # (B, C, K-1+T)
    # (B, C, K-1+T) * (C, 1, K) -> (B, C, T); at T = 0 one padded column, cut (conv1d refuses an
    # input shorter than K): no output, the weights' gradients zeros, the window passed through
    y = F.conv1d(F.pad(full, (1, 0)) if T == 0 else full, conv.weight, conv.bias, groups=C)[..., :T]
    return y.transpose(1, 2).to(x.dtype), full[..., full.shape[-1] - (K - 1):]


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least (the norms' compute dtype, as transformers'), float64 kept."""
    return x if x.dtype == torch.float64 else x.float()


def load_hf(layer: nn.Module, hf: nn.Module, kind: str) -> None:
    """Copy ``hf``'s weights into ``layer``, whose parameters carry transformers' names (the
    checkpoint table is the identity): every key on both sides, every shape equal, else a
    ShapeError naming the keys; nothing is ignored."""
    ours, theirs = layer.state_dict(), hf.state_dict()
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        raise ShapeError(f"{kind} weights do not match {type(layer).__name__}: missing {missing}, "
                         f"not taken {extra}")
    for key, t in theirs.items():
        if t.shape != ours[key].shape:
            raise ShapeError(f"{kind} weight {key} must have shape {fmt_shape(ours[key].shape)}; "
                             f"got {fmt_shape(t.shape)}")
    with torch.no_grad():
        for key, t in theirs.items():
            ours[key].copy_(t)
