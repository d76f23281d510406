"""WeightFootprint: the bytes each part of a model occupies once loaded, read from the checkpoint's
tensor headers without loading a tensor; and the KV cache's bytes per token.

A memory budget (``engine/memory.py``) subtracts what each process holds from the budget, so
these must match what ``load_weights`` really allocates: a test compares them with the bytes the
workers report. Parts: attention of every layer (split by attention TP), routed experts (per
expert), gates (kept in float32 where the gate kind says so) and the rest (embeddings, LM head,
norms, dense MLPs, shared experts). Tensors of layers past ``num_layers`` (DeepSeek's MTP
module) and fp8 scales are not loaded, so not counted.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from moeflow.config import ModelConfig
from moeflow.model.attention import attention_for
from moeflow.model.checkpoint import CheckpointReader
from moeflow.model.family import Family
from moeflow.model.gate import gate_for

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightFootprint:
    attention_layers: int  # the attention of every layer, norms around it included
    per_expert: int  # one routed expert over every MoE layer
    routers: int  # every MoE layer's gate (and selection bias)
    other: int  # embeddings, LM head, final norm, dense MLPs, shared experts
    num_experts: int

    def attention_side(self, tp: int = 1) -> int:
        """What an attention process holds besides routed experts (a TP member: 1/tp of the attention)."""
        return self.attention_layers // tp + self.routers + self.other

    def experts(self, count: int) -> int:
        return count * self.per_expert

    @property
    def total(self) -> int:
        return self.attention_side() + self.experts(self.num_experts)


def weight_footprint(path: str, cfg: ModelConfig, family: Family, dtype: torch.dtype) -> WeightFootprint:
    """Bytes per part of the checkpoint at ``path`` loaded in ``dtype`` (headers only)."""
    reader = CheckpointReader(path, dtype)
    size = dtype.itemsize
    gate_size = 4 if gate_for(cfg).fp32_weights else size
    expert_keys = {family.expert_key(l, e, w): e for l in range(cfg.num_layers) if cfg.sparse_layers[l]
                   for e in range(cfg.num_experts) for w in range(3)}
    gate_keys = {k for l in range(cfg.num_layers) if cfg.sparse_layers[l]
                 for k in (family.gate_key(l), family.gate_bias_key(l)) if k}
    attention = experts = routers = other = 0
    by_file: dict[str, list[str]] = {}
    for key, file in reader.key_file.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key in keys:
                m = _LAYER.search(key)
                if key.endswith("_scale_inv") or (m and int(m.group(1)) >= cfg.num_layers):
                    continue
                numel = math.prod(f.get_slice(key).get_shape())
                if key in expert_keys:
                    experts += numel * size
                elif key in gate_keys:
                    routers += numel * (4 if key.endswith("bias") else gate_size)
                elif m and key.startswith(family.layer(int(m.group(1)))) and _is_attention(key, family, int(m.group(1))):
                    attention += numel * size
                else:
                    other += numel * size
    per_expert = experts // cfg.num_experts if cfg.num_experts else 0
    return WeightFootprint(attention, per_expert, routers, other, cfg.num_experts)


def _is_attention(key: str, family: Family, layer: int) -> bool:
    return key.startswith(family.attention_prefix(layer)) or key in (family.input_norm_key(layer),
                                                                      family.post_norm_key(layer))


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What one cached token costs over all layers (``cfg`` of a TP member: its share)."""
    layout = attention_for(cfg).kv_layout()
    return cfg.num_layers * dtype.itemsize * sum(math.prod(shape) for shape in layout.values())
