"""Tensor-parallel slicing of a model for member ``rank`` of ``size``: the attention kind decides
what each member keeps of every layer's attention.

Everything else (embeddings, norms, MoE gate, dense MLPs, shared experts, LM head) stays whole on
every member. The attention output becomes a partial sum that the caller all-reduces.
"""
from __future__ import annotations

import dataclasses

from moeflow.config import ModelConfig
from moeflow.model.attention import attention_for
from moeflow.model.weights import ModelWeights


def check_tp(cfg: ModelConfig, size: int) -> None:
    attention_for(cfg).check_tp(size)


def shard_attention(cfg: ModelConfig, w: ModelWeights, rank: int, size: int) -> tuple[ModelConfig, ModelWeights]:
    """-> (the member's config, the member's weights)."""
    kind = attention_for(cfg)
    kind.check_tp(size)
    if size == 1:
        return cfg, w
    attention = {lid: kind.shard(a, rank, size) for lid, a in w.attention.items()}
    return kind.member_config(size), dataclasses.replace(w, attention=attention)
