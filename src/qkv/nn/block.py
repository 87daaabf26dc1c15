"""The transformer block: pre-norm attention and feed-forward, each added to the residual stream.

Forward on ``x (B, T, d_model)`` (GPT-2's and nanoGPT's order)::

    x = x + drop(attn(ln_1(x)))       attention: any qkv attention layer
    y = x + drop(mlp(ln_2(x)))        feed-forward: :class:`~qkv.nn.MLP`

``attn`` may instead be a recurrent mixer (:class:`~qkv.nn.Mamba2`,
:class:`~qkv.nn.GatedDeltaNet`, :class:`~qkv.nn.RGLRU`): the same block with the mixer in
attention's place, its parameters named ``mixer.<its names>`` and its decoding state
(:class:`~qkv.nn.RecurrentState`) playing the cache's part.

Backward reverses it; each residual passes its gradient through unchanged and adds the
branch's::

    dx = dy + ln_2'(mlp'(drop'(dy)))
    dx = dx + ln_1'(attn'(drop'(dx)))
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError, positive_int
from .attention_layer import AttentionLayer
from .base import Layer
from .layers import Dropout
from .gated_delta import GatedDeltaNet
from .linear_attention import LinearAttention
from .mamba2 import Mamba2
from .mlp import MLP
from .norms import LayerNorm, RMSNorm
from .rglru import RGLRU
from .short_conv import ConvAttention
from .zoology import BasedAttention, ConvMixer

NORMS = ("layernorm", "rmsnorm")
RECURRENT_MIXERS = (Mamba2, GatedDeltaNet, RGLRU, ConvMixer, BasedAttention)  # layers with new_state(batch) and forward(x, state=)


class TransformerBlock(Layer):
    """A pre-norm block around ``attn`` (a :class:`~qkv.nn.MultiHeadAttention` with GQA, RoPE,
    window or chunk, a :class:`~qkv.nn.LatentAttention`, a :class:`~qkv.nn.LinearAttention`, ...).

    ``mlp`` defaults to ``MLP(d_model, 4 * d_model, activation, bias)``; ``norm`` is
    ``"layernorm"`` (``eps`` 1e-5, with a bias when ``bias``) or ``"rmsnorm"`` (``eps`` 1e-6
    unless given); ``dropout`` is the residual dropout after each branch (identity in ``eval()``).

    Parameters, flat: ``ln_1.weight``, ``ln_1.bias``, ``attn.<its names>`` (``attn.W_Q``, ...;
    ``mixer.<its names>`` for a recurrent mixer), ``ln_2.weight``, ``ln_2.bias``, ``mlp.<its names>``
    (``mlp.W_fc``, ...); the sublayers hold the arrays (``block.attn``, ``block.mlp``, ``block.ln_1``, ``block.ln_2``).
    """

    def __init__(self, d_model: int, attn: Layer, mlp: Layer | None = None, norm: str = "layernorm",
                 dropout: float = 0.0, *, bias: bool = True, activation: str = "gelu", eps: float | None = None,
                 dtype=np.float32, rng: np.random.Generator | None = None):
        super().__init__(dtype=dtype, rng=rng)
        self.d_model = positive_int("d_model", d_model)
        if not isinstance(attn, (AttentionLayer, ConvAttention) + RECURRENT_MIXERS):
            raise ShapeError(f"attn must be a qkv.nn attention layer (MultiHeadAttention, LatentAttention, "
                             f"LinearAttention, ConvAttention, ...) or a recurrent mixer (Mamba2, GatedDeltaNet, "
                             f"RGLRU); got {type(attn).__name__}")
        if attn.d_model != self.d_model:
            raise ShapeError(f"attn must have d_model = {self.d_model}; got {attn.d_model}")
        if norm not in NORMS:
            raise ShapeError(f"norm must be one of {list(NORMS)}; got {norm!r}")
        self.attn = attn
        self.mlp = MLP(self.d_model, activation=activation, bias=bias, dtype=self.dtype, rng=self.rng) \
            if mlp is None else mlp
        if getattr(self.mlp, "d_model", self.d_model) != self.d_model:
            raise ShapeError(f"mlp must have d_model = {self.d_model}; got {self.mlp.d_model}")
        if norm == "layernorm":
            make = lambda: LayerNorm(self.d_model, 1e-5 if eps is None else eps, bias, dtype=self.dtype)  # noqa: E731
        else:
            make = lambda: RMSNorm(self.d_model, 1e-6 if eps is None else eps, dtype=self.dtype)  # noqa: E731
        self.ln_1, self.ln_2 = make(), make()
        self.drop_1 = Dropout(dropout, self.rng, dtype=self.dtype)
        self.drop_2 = Dropout(dropout, self.rng, dtype=self.dtype)
        links = {}
        mixer = "mixer" if self.recurrent else "attn"
        for prefix, layer in (("ln_1", self.ln_1), (mixer, self.attn), ("ln_2", self.ln_2), ("mlp", self.mlp)):
            links.update({f"{prefix}.{name}": (layer, name) for name in layer.params})
        self._expose(links)
        self._sublayers += [self.drop_1, self.drop_2]  # no parameters, but train()/eval() reach them

    @property
    def recurrent(self) -> bool:
        """True when the mixer is a recurrent layer (Mamba2, GatedDeltaNet, RGLRU)."""
        return isinstance(self.attn, RECURRENT_MIXERS)

    @property
    def stateful(self) -> bool:
        """True when decoding keeps a state of fixed size (a recurrent mixer or LinearAttention), not a cache."""
        return self.recurrent or isinstance(self.attn, LinearAttention)

    def new_cache(self, batch: int, max_len: int):
        """The attention layer's cache (or, for LinearAttention and a recurrent mixer, its decoding state)."""
        if self.stateful:
            return self.attn.new_state(batch)
        return self.attn.new_cache(batch, max_len)

    def _attn_kwargs(self, cache, q_lengths, kv_lengths) -> dict:
        if self.stateful:  # its decoding state plays the cache's part
            if q_lengths is not None or kv_lengths is not None:
                raise ShapeError(f"q_lengths= and kv_lengths= are not taken by a block around "
                                 f"{type(self.attn).__name__} (its state holds one length for the batch)")
            return {} if cache is None else {"state": cache}
        kwargs = {"cache": cache, "q_lengths": q_lengths, "kv_lengths": kv_lengths}
        return {k: v for k, v in kwargs.items() if v is not None}

    def forward(self, x, *, cache=None, q_lengths=None, kv_lengths=None) -> np.ndarray:
        """``x (B, T, d_model) -> (B, T, d_model)``; ``cache``, ``q_lengths`` and ``kv_lengths``
        go to the attention layer (see its ``forward``)."""
        kwargs = self._attn_kwargs(cache, q_lengths, kv_lengths)
        x = x + self.drop_1.forward(self.attn.forward(self.ln_1.forward(x), **kwargs))  # (B, T, d_model)
        return x + self.drop_2.forward(self.mlp.forward(self.ln_2.forward(x)))

    def backward(self, dy) -> np.ndarray:
        """Fill ``grads`` from ``dy (B, T, d_model)``; return ``dx (B, T, d_model)``."""
        dx = dy + self.ln_2.backward(self.mlp.backward(self.drop_2.backward(dy)))
        return dx + self.ln_1.backward(self.attn.backward(self.drop_1.backward(dx)))
