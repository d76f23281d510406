"""Qwen2-MoE (``Qwen2MoeForCausalLM``): qkv bias, a shared expert scaled by a sigmoid gate."""
from moeflow.config import ModelConfig
from moeflow.model.family import Family, common_fields, get, qwen_sparse_layers, register


def to_model_config(hf: dict) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2MoeForCausalLM",
        attention_kind="gqa",
        gate_kind="softmax_topk",
        num_experts=get(hf, "num_experts", "num_local_experts"),
        num_experts_per_tok=get(hf, "num_experts_per_tok"),
        moe_intermediate_size=get(hf, "moe_intermediate_size"),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=qwen_sparse_layers(hf),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_expert_gated=True,
        # Qwen2 always had q/k/v bias; transformers v5 spells it out as ``qkv_bias``
        qkv_bias=bool(hf.get("qkv_bias", True)),
        **common_fields(hf),
    )


FAMILY = register(Family("Qwen2MoeForCausalLM", to_model_config, "mlp", ("gate_proj", "up_proj", "down_proj")))
