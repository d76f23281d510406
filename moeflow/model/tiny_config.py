"""The embedded default model's Hugging Face config (``model/tiny.py`` writes the checkpoint).

Torch-free: the simulator derives its ``tiny`` preset from it through the Qwen3-MoE family.
"""

TINY_VERSION = 3
TINY_HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 258,  # byte-level tokenizer: 256 bytes + <bos> + <eos>
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 640,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

# The DeepSeek-shaped embedded model ("tiny-mla"): MLA with q LoRA, sigmoid routing in 4 groups (2
# kept), a shared expert, one leading dense layer. Sized like tiny: the same hidden size and layer
# count, and per token about the same attention and expert work (projections ~2.9M vs 2.6M MACs,
# routed + shared experts 7.9M as tiny's 4 x 640-wide experts).
TINY_MLA_VERSION = 1
TINY_MLA_HF_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 258,  # byte-level tokenizer: 256 bytes + <bos> + <eos>
    "hidden_size": 1024,
    "intermediate_size": 2048,  # the leading dense layer
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}

# name -> (config, version): the models LLM("tiny") etc. write on first use
EMBEDDED = {"tiny": (TINY_HF_CONFIG, TINY_VERSION), "tiny-mla": (TINY_MLA_HF_CONFIG, TINY_MLA_VERSION)}
