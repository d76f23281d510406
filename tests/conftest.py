"""Shared fixtures: small random Hugging Face MoE checkpoints, built once per session.

Every checkpoint is made by transformers itself (``from_config`` + ``save_pretrained``), so the
tests read exactly what a real model directory holds. Sizes are tiny (hidden 64, 2-4 layers,
vocab <= 300): the whole unit suite shares two CPU cores.
"""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)

# Base configs per family; a named variant below overrides fields. initializer_range 0.2 (10x the
# usual) keeps logits far from uniform, so parity checks compare distinct, well-separated values.
_BASE = {
    "qwen3_moe": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
    "mixtral": dict(
        vocab_size=200, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
    "qwen2_moe": dict(
        vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
    # MLA with q LoRA, sigmoid routing in 2 groups (1 kept), a leading dense layer, 2 shared experts
    "deepseek_v3": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
}
_BASE["deepseek_v32"] = dict(_BASE["deepseek_v3"], index_n_heads=8, index_head_dim=16, index_topk=12)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

# name -> (model_type, overrides). Each variant exercises one loader/model path.
VARIANTS: dict[str, tuple[str, dict]] = {
    # head_dim 24 != hidden 64 / 4 heads; renormalized top-k; vocab >= 258 for the byte tokenizer
    "qwen3": ("qwen3_moe", {}),
    # dense MLP layers mixed in two ways
    "qwen3_mlp_only": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_sparse_step2": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),
    # raw (not renormalized) top-k weights, q/k/v/o biases
    "qwen3_bias_nonorm": ("qwen3_moe", dict(norm_topk_prob=False, attention_bias=True)),
    # LM head tied to the embedding: save_pretrained writes no lm_head.weight
    "qwen3_tied": ("qwen3_moe", dict(tie_word_embeddings=True)),
    "mixtral": ("mixtral", {}),
    # shared expert with its sigmoid gate, q/k/v bias, and one dense layer
    "qwen2_moe": ("qwen2_moe", dict(mlp_only_layers=[1])),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_noqlora": ("deepseek_v3", dict(q_lora_rank=None)),  # q straight from the hidden state
    "deepseek_v3_yarn": ("deepseek_v3", dict(rope_parameters=_YARN)),  # YaRN + the softmax-scale correction
    "deepseek_v32": ("deepseek_v32", {}),  # DSA: index_topk 12 (prompts are longer)
}


def build_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random transformers MoE model in float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**_BASE[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # transformers initializes norm weights to 1 and biases to 0; perturb them so a loader that
    # dropped or swapped one would change the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek's routing bias starts at 0: a loader that dropped it would pass
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def save_checkpoint(model, path: str, **save_kwargs) -> str:
    model.save_pretrained(path, **save_kwargs)
    return path


class Checkpoint:
    """A saved checkpoint and the in-memory transformers model it was written from."""

    def __init__(self, name: str, path: str, model):
        self.name, self.path, self.model = name, path, model

    def __repr__(self) -> str:
        return f"Checkpoint({self.name})"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazy, session-wide cache: ``checkpoints(name)`` builds the named variant once."""
    cache: dict[str, Checkpoint] = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def get(name: str) -> Checkpoint:
        if name not in cache:
            model_type, overrides = VARIANTS[name]
            model = build_hf_model(model_type, **overrides)
            path = save_checkpoint(model, os.path.join(root, name))
            cache[name] = Checkpoint(name, path, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def llm_cache():
    """``llm_cache(path, **kwargs)``: one moeflow LLM per (checkpoint, settings) for the session."""
    from moeflow import LLM

    cache: dict = {}

    def get(path: str, **kwargs):
        key = (path, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = LLM(path, **kwargs)
        return cache[key]

    yield get
    for llm in cache.values():
        llm.shutdown()
