"""The config.json fields of the models the simulator prices (its presets, ``model_spec.py``), each
as published on the Hugging Face Hub; docs/simulator.md links them."""

# Qwen/Qwen3-235B-A22B config.json on the Hugging Face Hub (bf16), the fields the spec reads.
QWEN3_235B_A22B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
}


# deepseek-ai/DeepSeek-V3.2-Exp config.json on the Hugging Face Hub, the fields the spec reads.
DEEPSEEK_V32_HF = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 2048, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_theta": 10000, "torch_dtype": "bfloat16",
}


# deepseek-ai/DeepSeek-R1 config.json on the Hugging Face Hub (DeepSeek-V3's architecture, no indexer).
DEEPSEEK_R1_HF = {k: v for k, v in DEEPSEEK_V32_HF.items() if not k.startswith("index_")} | {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "scoring_func": "sigmoid",
    "topk_method": "noaux_tc"}


# MiniMaxAI/MiniMax-M2.5: the MiniMax-M2 architecture (its deployment guides serve M2, M2.1 and M2.5
# alike, "you only need to change the model name"), with the fields of transformers' MiniMaxM2Config
# (230B parameters, 10B active: 256 experts of 3 x 3072 x 1536, top 8, in each of 62 layers)
MINIMAX_M2_HF = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
    "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256, "num_experts_per_tok": 8,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 196608, "rope_theta": 5000000.0, "torch_dtype": "bfloat16",
}
