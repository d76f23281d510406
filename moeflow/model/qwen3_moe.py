"""Qwen3-MoE (``Qwen3MoeForCausalLM``): q/k RMSNorm, optional attention bias, no shared expert."""
from moeflow.config import ModelConfig
from moeflow.model.family import Family, common_fields, get, qwen_sparse_layers, register


def to_model_config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        attention_kind="gqa",
        gate_kind="softmax_topk",
        num_experts=get(hf, "num_experts", "num_local_experts"),
        num_experts_per_tok=get(hf, "num_experts_per_tok"),
        moe_intermediate_size=get(hf, "moe_intermediate_size"),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=qwen_sparse_layers(hf),
        qk_norm=True,
        qkv_bias=bias,
        o_bias=bias,
        **common_fields(hf),
    )


FAMILY = register(Family("Qwen3MoeForCausalLM", to_model_config, "mlp", ("gate_proj", "up_proj", "down_proj")))
