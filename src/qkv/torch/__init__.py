"""qkv inside PyTorch (extra ``torch``): qkv's attention as custom operators with autograd,
the texts' modules, and ``attn_implementation="qkv"`` for Hugging Face transformers.

- :func:`attention` (q, k, v, **every option of qkv.attention): CPU tensors in SDPA's
  layout, differentiable in q, k and v, one node under ``torch.compile``.
- :class:`SelfAttention` (d_model, d_k): the texts' module (``W_Q``, ``W_K``, ``W_V`` as
  ``nn.Linear(d_model, d_k, bias=False)``), its ``state_dict`` interchangeable with theirs.
- :class:`MultiHeadAttention`: :class:`qkv.nn.MultiHeadAttention` as an ``nn.Module``
  (GQA/MQA, causal, window, RoPE, ALiBi, kv_lengths, :class:`KVCache` with a length per
  sequence, as :class:`qkv.nn.KVCache`), convertible both ways, with the NumPy layer's checks.
- :func:`register_hf`: ``AutoModel.from_pretrained(path, attn_implementation="qkv")``;
  ``register_hf(recurrent=True)`` (or the context :func:`hf_recurrent_kernels`): transformers'
  recurrent kernel functions (fla's, mamba_ssm's, causal_conv1d's) on qkv's.
- :func:`decay_attention`, :func:`delta_rule`, :func:`dplr`, :func:`linear_scan`: the
  recurrences of :mod:`qkv.recurrent` on CPU tensors, differentiable in every tensor input
  (the initial state, and through the returned final state, too), one node under
  ``torch.compile``.
- :class:`Mamba2`, :class:`GatedDeltaNet`, :class:`RGLRU`: transformers' ``Mamba2Mixer``, Gated
  DeltaNet (Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's) and ``RecurrentGemmaRecurrentBlock`` on
  those operators (``from_hf``), decoding token by token with a :class:`RecurrentState`.

- :mod:`qkv.torch.hf_kernels`: transformers' replaceable recurrent kernels (fla's
  ``chunk_gated_delta_rule``, ``chunk_kda``, ...) under their packages' names and signatures.

``import qkv`` does not import this package (nor torch); ``import qkv.torch`` does.
"""
from ..extras import require

require("torch", "torch")

from .functional import attention  # noqa: E402  (after the check that torch is there)
from .hf import register_hf  # noqa: E402
from .hf_recurrent import hf_recurrent_kernels  # noqa: E402
from .modules import SelfAttention  # noqa: E402
from .layer_state import RecurrentState  # noqa: E402
from .multihead import KVCache, MultiHeadAttention  # noqa: E402
from .recurrent_layers import GatedDeltaNet, Mamba2  # noqa: E402
from .recurrent_ops import decay_attention, delta_rule, dplr, linear_scan  # noqa: E402
from .rglru import RGLRU  # noqa: E402

__all__ = ["attention", "SelfAttention", "MultiHeadAttention", "KVCache", "register_hf", "hf_recurrent_kernels",
           "decay_attention", "delta_rule", "dplr", "linear_scan", "Mamba2", "GatedDeltaNet", "RGLRU",
           "RecurrentState"]
