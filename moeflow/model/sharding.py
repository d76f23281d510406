"""Tensor-parallel slicing of the attention weights: member ``rank`` of ``size`` keeps its heads.

Everything else (embeddings, norms, router, dense MLPs, shared experts, LM head) stays whole on
every member. The o-projection becomes a partial sum that the caller all-reduces.
"""
from __future__ import annotations

import dataclasses

import torch

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.weights import ModelWeights


def check_tp(cfg: ModelConfig, size: int) -> None:
    if cfg.num_heads % size or cfg.num_kv_heads % size:
        raise ConfigError(f"attention TP size {size} must divide num_heads ({cfg.num_heads}) and "
                          f"num_kv_heads ({cfg.num_kv_heads})")


def shard_attention(cfg: ModelConfig, w: ModelWeights, rank: int, size: int) -> tuple[ModelConfig, ModelWeights]:
    check_tp(cfg, size)
    if size == 1:
        return cfg, w
    d = cfg.head_dim
    hq, hkv = cfg.num_heads // size, cfg.num_kv_heads // size
    q0, k0 = rank * hq * d, rank * hkv * d
    q_rows = slice(q0, q0 + hq * d)
    k_rows = slice(cfg.q_size + k0, cfg.q_size + k0 + hkv * d)
    v_rows = slice(cfg.q_size + cfg.kv_size + k0, cfg.q_size + cfg.kv_size + k0 + hkv * d)

    def rows(t):  # this member's q, k and v rows of the fused qkv matrix (or bias)
        return None if t is None else torch.cat([t[q_rows], t[k_rows], t[v_rows]])

    attention = {
        lid: dataclasses.replace(a, qkv=rows(a.qkv), qkv_bias=rows(a.qkv_bias), o=a.o[:, q_rows].contiguous())
        for lid, a in w.attention.items()
    }
    member_cfg = dataclasses.replace(cfg, num_heads=hq, num_kv_heads=hkv)
    return member_cfg, dataclasses.replace(w, attention=attention)

