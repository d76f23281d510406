"""Attention kinds, one per file; ``ModelConfig.attention_kind`` names the one a model uses.

Adding a kind = one file with an ``AttentionKind`` subclass and one entry in ``ATTENTION_KINDS``.
"""
from __future__ import annotations

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.attention.base import AttentionKind, AttentionWeights, KVLayout
from moeflow.model.attention.dsa import DSA
from moeflow.model.attention.gqa import GQA
from moeflow.model.attention.mla import MLA

ATTENTION_KINDS: dict[str, type[AttentionKind]] = {GQA.name: GQA, MLA.name: MLA, DSA.name: DSA}

__all__ = ["ATTENTION_KINDS", "AttentionKind", "AttentionWeights", "KVLayout", "attention_for"]


def attention_for(cfg: ModelConfig) -> AttentionKind:
    kind = ATTENTION_KINDS.get(cfg.attention_kind)
    if kind is None:
        raise ConfigError(f"unknown attention kind {cfg.attention_kind!r}; known: {sorted(ATTENTION_KINDS)}")
    return kind(cfg)
