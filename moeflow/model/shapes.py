"""Model shapes without checkpoints: public Hugging Face ``config.json`` dicts that ``bench roofline``
builds random-weight models from, and the same config cut to its first N layers.

Torch-free (a config is a dict; the family translates it). The dicts hold the facts of each model's
config.json on the Hugging Face Hub that the family reads.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from moeflow.config import ConfigError
from moeflow.model.tiny_config import EMBEDDED

# Qwen/Qwen3-30B-A3B config.json
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

# deepseek-ai/DeepSeek-V2-Lite config.json, presented through DeepSeek-V3's family: moeflow has no
# DeepSeek-V2 gate (softmax scores, greedy top-k), so V3's sigmoid "noaux_tc" gate stands in with
# one group. The shapes (MLA, 64 routed experts top-6, 2 shared, one leading dense layer) are V2-Lite's;
# a gate's own cost is one [T, H] x [H, E] product either way.
DEEPSEEK_V2_LITE_HF = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc",  # V2-Lite's own: "softmax", "greedy"
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

V2_LITE_NOTE = ("DeepSeek-V2-Lite's shapes through moeflow's DeepSeek-V3 family: its MoE gate is V3's sigmoid "
                "'noaux_tc' in one group, not V2's softmax greedy top-k (moeflow has no V2 gate)")


@dataclass(frozen=True)
class Shape:
    name: str  # preset name or the config.json path
    hf: dict  # the Hugging Face config, all layers
    note: str = ""  # how the shape departs from the named model, if it does


PRESETS = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", QWEN3_30B_A3B_HF),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", DEEPSEEK_V2_LITE_HF, V2_LITE_NOTE),
    **{name: Shape(name, hf) for name, (hf, _) in EMBEDDED.items()},
}


def shape_for(name: str) -> Shape:
    """A preset by name, or a config.json (or a directory holding one)."""
    if name in PRESETS:
        return PRESETS[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ConfigError(f"unknown shape {name!r}: neither a preset ({', '.join(sorted(PRESETS))}) "
                          f"nor a config.json")
    with open(path) as f:
        return Shape(name, json.load(f))


def first_layers(hf: dict, num_layers: int) -> dict:
    """``hf`` cut to its first ``num_layers`` layers. Leading dense layers stay as the model has them,
    but at least one layer stays MoE (a 1-layer cut of DeepSeek is its first MoE layer, not its dense one)."""
    total = hf["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ConfigError(f"layers must be in 1..{total} for this shape, got {num_layers}")
    out = dict(hf, num_hidden_layers=num_layers)
    if hf.get("first_k_dense_replace"):
        out["first_k_dense_replace"] = min(int(hf["first_k_dense_replace"]), num_layers - 1)
    if hf.get("mlp_only_layers"):
        out["mlp_only_layers"] = [i for i in hf["mlp_only_layers"] if i < num_layers]
    if hf.get("mlp_layer_types"):
        out["mlp_layer_types"] = list(hf["mlp_layer_types"][:num_layers])
    return out
