"""The transformers families whose modeling code calls the replaceable recurrent kernel functions
(fla's, mamba_ssm's, causal_conv1d's), each as a tiny random config: 2 layers, hidden 32, a
recurrent layer first. Used by tests/torch_hf/test_hf_hybrid_families.py.

``FAMILIES``: name -> (model_type, config overrides). ``BY_CLASS``: the families built by class,
their causal LM not being in transformers' auto mapping. ``NOT_IN_HARNESS``: the families that call
the functions but have no tiny config here yet, with why (docs/torch.md lists both).
"""
from __future__ import annotations

import importlib

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, pad_token_id=0, tie_word_embeddings=False)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
              mamba_chunk_size=8)
SELECTIVE = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
INKLING = dict(layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=2, swa_num_key_value_heads=1,
               swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16)
# the head has unpadded_vocab_size rows (default 200058); intermediate_size is the experts' width
INKLING2 = dict(INKLING, unpadded_vocab_size=97, n_routed_experts=4, num_experts_per_tok=2, intermediate_size=16)

FAMILIES = {
    "Qwen3-Next": ("qwen3_next", {**COMMON, **GDN, **MOE}),
    "Qwen3.5": ("qwen3_5_text", {**COMMON, **GDN}),
    "Qwen3.5-MoE": ("qwen3_5_moe_text", {**COMMON, **GDN, **MOE}),
    "OLMo-Hybrid": ("olmo_hybrid", {**COMMON, **GDN}),
    "Kimi Linear": ("kimi_linear", {**COMMON, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_token": 2,
                                    "moe_intermediate_size": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 8,
                                    "qk_nope_head_dim": 8, "v_head_dim": 16,
                                    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2],
                                                           "head_dim": 8, "num_heads": 2,
                                                           "short_conv_kernel_size": 4}}),
    "Bailing-Hybrid": ("bailing_hybrid", {**COMMON, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_token": 2,
                                          "moe_intermediate_size": 16, "num_expert_group": 1, "kv_lora_rank": 8,
                                          "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                          "linear_head_dim": 8, "linear_num_heads": 2, "layer_group_size": 2,
                                          "num_nextn_predict_layers": 0}),
    "Mamba-2": ("mamba2", {**COMMON, "num_heads": 4, "head_dim": 16, "expand": 2, "state_size": 8,
                           "n_groups": 1, "conv_kernel": 4, "chunk_size": 8}),
    "Bamba": ("bamba", {**COMMON, **MAMBA2, "attn_layer_indices": [1]}),
    "Falcon-H1": ("falcon_h1", {**COMMON, **MAMBA2, "mamba_d_ssm": 64}),
    "NemotronH": ("nemotron_h", {**COMMON, "layers_block_type": ["linear_attention", "full_attention"],
                                 "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1,
                                 "conv_kernel": 4, "chunk_size": 8}),
    "Zamba2": ("zamba2", {**COMMON, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
                          "n_mamba_heads": 4, "mamba_headdim": 16, "chunk_size": 8, "layers_block_type": ["linear_attention", "hybrid"],
                          "attention_head_dim": 16, "num_key_value_heads": 2}),
    "GraniteMoeHybrid": ("granitemoehybrid", {**COMMON, **MAMBA2, "num_local_experts": 4,
                                              "num_experts_per_tok": 2, "shared_intermediate_size": 16,
                                              "layer_types": ["linear_attention", "full_attention"]}),
    "Jamba": ("jamba", {**COMMON, **SELECTIVE, "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1,
                        "expert_layer_period": 2, "expert_layer_offset": 1}),
    "Mamba": ("mamba", {**COMMON, "state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 4}),
    "FalconMamba": ("falcon_mamba", {**COMMON, "state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 4}),
    "Zamba": ("zamba", {**COMMON, **SELECTIVE, "n_mamba_heads": 2, "layers_block_type": ["linear_attention", "hybrid"],
                        "attention_head_dim": 16, "num_key_value_heads": 2, "attention_hidden_size": 64}),
    "LFM2": ("lfm2", {**COMMON, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3,
                      "block_auto_adjust_ff_dim": False}),
    # num_dense_layers=1: the second layer's feed-forward is the sparse MoE
    "LFM2-MoE": ("lfm2_moe", {**COMMON, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3,
                              "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 16}),
    "LFM3": ("lfm3", {**COMMON, "layer_types": ["conv", "full_attention"], "conv_L_cache": 3}),
    "Lara-Mini": ("lara_mini", {**COMMON, **GDN, **MOE}),
    # the QSA indexer's budget (64 tokens in blocks of 4) covers every block at the harness's lengths
    # (T <= 40): its top-k keeps every visible token, so no selection can flip between two float paths
    "Qwen4-Exp": ("qwen4_exp_text", {**COMMON, **GDN, **MOE, "layer_types": ["linear_attention", "indexed_attention"],
                                     "hc_count": 2, "hc_lowrank": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                                     "indexer_head_dim": 16, "indexer_budget": 64, "indexer_compress_ratio": 4}),
    # NoPE MLA (DSA) with q_lora_rank, as GLM-5-Next's config requires; the DSA indexer's top-k (64 in
    # pools of 4) covers every token at the harness's lengths, as Qwen4-Exp's indexer above
    "GLM-5-Next": ("glm5_next_text", {**COMMON, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8,
                                      "qk_rope_head_dim": 0, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                      "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                      "mlp_layer_types": ["dense", "sparse"],
                                      "layer_types": ["linear_attention", "indexed_attention"],
                                      "index_topk": 64, "index_kpool": 4, "index_head_dim": 16, "index_n_heads": 2,
                                      "linear_head_dim": 8, "linear_num_heads": 2, "linear_conv_kernel_dim": 4,
                                      "hc_mult": 2}),
    # The Inklings: every decoder layer is attention with causal short convolutions (Inkling: on k, v and
    # after the attention and the MLP; Inkling2: the same in the sliding-window layers, after the attention
    # and the MLP in the full ones), so the sliding-window layer first; the window (8) is shorter than the
    # harness's sequences. Their text causal LMs are in the auto mapping under the *_text model types.
    "Inkling": ("inkling_text", {**COMMON, **INKLING, "mlp_layer_types": ["dense", "sparse"], "n_routed_experts": 4,
                                 "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16}),
    "Inkling2": ("inkling2_text", {**COMMON, **INKLING2}),
    # the loop (loop_layer_index_start..end) is the sliding-window layer, run twice, each pass on its own
    # cache layer for every convolution state
    "Inkling2-Loop": ("inkling2_loop_text", {**COMMON, **INKLING2, "layer_types": ["hybrid", "hybrid_sliding"],
                                             "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                                             "loop_layer_index_end": 2, "loop_num_passes": 2, "loop_gate_rank": 8}),
}

# Families whose causal LM is not in AutoModelForCausalLM's mapping under their text config's
# model_type: family -> (the transformers class to build, the model_type of the config that wraps
# the text config as its text_config, that config's other overrides).
#
# GLM-5-Next has no text-only causal-LM class: its language model is the text half of
# Glm5NextForConditionalGeneration, which its text-only checkpoints load into (Glm5NextConfig takes a
# flat checkpoint's fields as its text_config). Given input_ids alone it is a causal LM over text,
# with transformers' own head, loss and generate, so the harness's checks run on it unchanged. Its
# vision tower is built tiny and never called; its weights get no gradient, and the gradient check
# compares the parameters that have one.
BY_CLASS = {
    "GLM-5-Next": ("Glm5NextForConditionalGeneration", "glm5_next",
                   {"vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                                      "out_hidden_size": 32, "projection_intermediate_size": 16}}),
}

NOT_IN_HARNESS: dict[str, str] = {}


def build(family: str, seed: int = 0, dtype=None, **extra):
    """The family's tiny causal LM, random weights from ``seed``, in eval mode."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    model_type, overrides = FAMILIES[family]
    cfg = CONFIG_MAPPING[model_type](**{**overrides, **extra})
    kw = dict(attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    if family in BY_CLASS:
        class_name, wrapper_type, wrapper_overrides = BY_CLASS[family]
        cfg = CONFIG_MAPPING[wrapper_type](text_config=cfg, **wrapper_overrides)
        model = getattr(transformers, class_name)._from_config(cfg, **kw)
    else:
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def modeling_module(model):
    """The modeling module whose functions the model's recurrent layers call."""
    return importlib.import_module(type(model).__module__)


def functions_used(model) -> list[str]:
    """transformers' replaceable recurrent kernel functions the model's modeling module calls."""
    from qkv.torch import hf_recurrent

    module = modeling_module(model)
    names = {hf_recurrent.kernel_name(getattr(obj, "__wrapped__", obj)) for obj in vars(module).values()}
    return sorted(n for n in names if n is not None)
