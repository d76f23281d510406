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
