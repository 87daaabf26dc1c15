"""transformers' replaceable recurrent kernels (``use_kernel_func_from_hub_with_fallback(name,
package)``) under their packages' own names and signatures, on qkv's recurrences: CPU, exact,
differentiable, with packed sequences (``cu_seqlens``, ``seq_idx``). ``qkv.torch.register_hf(
recurrent=True)`` makes transformers' models call them.

- :mod:`.fla`: flash-linear-attention's ``chunk_gated_delta_rule``,
  ``fused_recurrent_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid), ``chunk_kda``,
  ``fused_recurrent_kda`` (Kimi Linear);
- :mod:`.mamba`: mamba_ssm's ``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``
  (Mamba-2, Bamba, Falcon-H1, NemotronH, Zamba2, GraniteMoeHybrid);
- :mod:`.selective`: mamba_ssm's ``selective_scan_fn`` (Mamba-1: Mamba, FalconMamba, Jamba) and
  ``selective_state_update`` (a decoding step, both generations);
- :mod:`.conv`: causal_conv1d's ``causal_conv1d_fn`` and ``causal_conv1d_update``.
"""
from .conv import causal_conv1d_fn, causal_conv1d_update
from .fla import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from .mamba import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from .selective import selective_scan_fn, selective_state_update

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda",
           "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "selective_scan_fn",
           "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"]
