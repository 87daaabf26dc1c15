"""Trainable attention layers in NumPy, each with ``forward`` and ``backward``.

Every layer holds ``params`` and ``grads`` (dicts of named arrays with the same keys),
takes ``dtype`` (float32 by default) and ``rng`` (a ``numpy.random.Generator``) and
computes its attention through :func:`qkv.attention` / :func:`qkv.attention_backward`.

- :class:`SelfAttention`: the texts' single head (``W_Q, W_K, W_V``).
- :class:`MultiHeadAttention`: self/cross, MHA/GQA/MQA, causal, window, RoPE, ALiBi,
  padding lengths, KV cache (:class:`KVCache`).
- :class:`LatentAttention`: DeepSeek's multi-head latent attention; its cache
  (:class:`LatentCache`) stores a low-rank latent and a shared RoPE key.
- :class:`LinearAttention`: linear attention (φ = elu + 1), MHA/GQA/MQA, self/cross, with a
  constant-size decoding state (:class:`LinearState`).
- :class:`Linear`, :class:`Embedding`, :func:`cross_entropy`, :class:`Adam`: enough to
  train a small model (``qkv train lookup``). The attention layers project through
  :class:`Linear` and share one base (``nn/attention_layer.py``).
- ``layer.eval()`` / ``layer.train()``: as in PyTorch; in eval mode a forward keeps nothing
  for backward (inference, less memory), ``train()`` (the default) turns it back on.
- :class:`LayerNorm`, :class:`RMSNorm`, :class:`MLP` (GELU, tanh GELU, SwiGLU), :class:`Dropout`
  and :class:`TransformerBlock` (pre-norm: ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, around any
  of the attention layers): what :class:`qkv.models.GPT` is made of; :class:`AdamW` (decoupled
  weight decay, gradient clipping, a state to resume from) and :func:`cosine_lr` train it.
- :class:`Mamba2`, :class:`GatedDeltaNet`, :class:`RGLRU`: the recurrent blocks of Mamba-2,
  Qwen3-Next (Qwen3.5, OLMo-Hybrid) and Griffin (``from_hf(module)`` from transformers),
  decoding through a :class:`RecurrentState` whose size does not grow with the tokens seen.
- :class:`BaseConv` and :class:`ConvAttention` (``nn/short_conv.py``): Zoology's short
  convolution, and its conv-then-attention mixer (cache :class:`ConvKVCache`); :class:`ConvMixer`
  (a BaseConv as a block's mixer) and :class:`BasedAttention` (Based's Taylor linear attention),
  Zoology's MQAR layers (``nn/zoology.py``).
- :func:`cache_table` (``nn/footprint.py``): KV-cache bytes per token of MHA, GQA, MQA and MLA.
- :func:`gradient_errors`: a finite-difference check of any layer's backward.
"""
from .block import TransformerBlock
from .cache import Cache, KVCache, LatentCache
from .footprint import cache_elements_per_token, cache_table, format_cache_table
from .gradcheck import gradient_errors
from .gated_delta import GatedDeltaNet
from .latent import LatentAttention
from .layers import Dropout, Embedding, Linear
from .linear_attention import LinearAttention, LinearState
from .mamba2 import Mamba2
from .mlp import MLP
from .multihead import MultiHeadAttention
from .norms import LayerNorm, RMSNorm
from .optim import Adam, AdamW, cosine_lr, cross_entropy
from .recurrent_parts import RecurrentState
from .rglru import RGLRU
from .self_attention import SelfAttention
from .short_conv import BaseConv, ConvAttention, ConvKVCache
from .zoology import BasedAttention, ConvMixer

__all__ = [
    "SelfAttention", "MultiHeadAttention", "LatentAttention", "LinearAttention", "LinearState",
    "Linear", "Embedding", "Dropout", "LayerNorm", "RMSNorm", "MLP", "TransformerBlock",
    "Adam", "AdamW", "cosine_lr", "cross_entropy", "Cache", "KVCache", "LatentCache", "cache_table",
    "cache_elements_per_token", "format_cache_table", "gradient_errors", "Mamba2", "GatedDeltaNet", "RGLRU",
    "RecurrentState", "BaseConv", "ConvAttention", "ConvKVCache", "ConvMixer", "BasedAttention",
]
