"""Mixtral (``MixtralForCausalLM``): every layer MoE, top-k weights always renormalized."""
from moeflow.config import ModelConfig
from moeflow.model.family import Family, common_fields, get, register


def to_model_config(hf: dict) -> ModelConfig:
    return ModelConfig(
        architecture="MixtralForCausalLM",
        attention_kind="gqa",
        gate_kind="softmax_topk",
        num_experts=get(hf, "num_local_experts", "num_experts"),
        num_experts_per_tok=get(hf, "num_experts_per_tok"),
        moe_intermediate_size=get(hf, "intermediate_size"),
        norm_topk_prob=True,
        sparse_layers=(True,) * get(hf, "num_hidden_layers"),
        **common_fields(hf),
    )


FAMILY = register(Family("MixtralForCausalLM", to_model_config, "block_sparse_moe", ("w1", "w3", "w2")))
