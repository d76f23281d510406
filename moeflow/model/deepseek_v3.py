"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``) and DeepSeek-V3.2 (``DeepseekV32ForCausalLM``):
multi-head latent attention (V3.2: with the DSA lightning indexer), sigmoid group-limited routing
with a selection bias, shared experts, leading dense layers. MTP layers past num_hidden_layers are
never read.
"""
from moeflow.config import ConfigError, ModelConfig
from moeflow.model.family import Family, common_fields, get, register


def _sparse_layers(hf: dict) -> tuple[bool, ...]:
    n = get(hf, "num_hidden_layers")
    if hf.get("mlp_layer_types"):  # V3.2's explicit list
        return tuple(t == "sparse" for t in hf["mlp_layer_types"][:n])
    first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    return tuple(i >= first and i % freq == 0 for i in range(n))


def _config(hf: dict, architecture: str, attention_kind: str) -> ModelConfig:
    scoring = hf.get("scoring_func", "sigmoid")
    method = hf.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ConfigError(f"{architecture}: routing scoring_func={scoring!r}, topk_method={method!r} is not "
                          f"supported (DeepSeek-V3's sigmoid 'noaux_tc' is)")
    f = get(hf, "moe_intermediate_size")
    rope_dim = get(hf, "qk_rope_head_dim")
    common = common_fields(hf)
    heads = common["num_heads"]
    common.update(head_dim=rope_dim, num_kv_heads=heads)  # one latent for all heads; head_dim: the rope dims
    return ModelConfig(
        architecture=architecture,
        num_experts=get(hf, "n_routed_experts"),
        num_experts_per_tok=get(hf, "num_experts_per_tok"),
        moe_intermediate_size=f,
        intermediate_size=int(hf.get("intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        sparse_layers=_sparse_layers(hf),
        shared_expert_intermediate_size=int(hf.get("n_shared_experts") or 0) * f,
        attention_kind=attention_kind,
        gate_kind="sigmoid_group",
        rope_interleave=bool(hf.get("rope_interleave", True)),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=get(hf, "kv_lora_rank"),
        qk_nope_head_dim=get(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=get(hf, "v_head_dim"),
        attention_bias=bool(hf.get("attention_bias", False)),
        index_n_heads=int(hf.get("index_n_heads") or 0) if attention_kind == "dsa" else 0,
        index_head_dim=int(hf.get("index_head_dim") or 0) if attention_kind == "dsa" else 0,
        index_topk=int(hf.get("index_topk") or 0) if attention_kind == "dsa" else 0,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        **common,
    )


def _v32(hf: dict) -> ModelConfig:
    for name in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
        if not hf.get(name):
            raise ConfigError(f"DeepseekV32ForCausalLM: config.json needs {name}")
    return _config(hf, "DeepseekV32ForCausalLM", "dsa")


_KEYS = dict(moe_prefix="mlp", expert_proj=("gate_proj", "up_proj", "down_proj"),
             shared_expert_module="shared_experts", gate_bias="e_score_correction_bias")
V3 = register(Family("DeepseekV3ForCausalLM", lambda hf: _config(hf, "DeepseekV3ForCausalLM", "mla"), **_KEYS))
V32 = register(Family("DeepseekV32ForCausalLM", _v32, **_KEYS))
