"""transformers' replaceable recurrent kernels (``use_kernel_func_from_hub_with_fallback(name,
package)``) under their packages' own names and signatures, on qkv's recurrences: CPU, exact,
differentiable, with packed sequences (``cu_seqlens``).

- :mod:`.fla`: flash-linear-attention's ``chunk_gated_delta_rule``,
  ``fused_recurrent_gated_delta_rule`` (Qwen3-Next, OLMo-Hybrid), ``chunk_kda``,
  ``fused_recurrent_kda`` (Kimi Linear).
"""
from .fla import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"]
