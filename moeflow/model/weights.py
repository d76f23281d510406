"""Hugging Face safetensors checkpoint -> moeflow's layout, loading only the requested subset.

Layout: attention as its kind lays it out (``model/attention/``); gate/up fused as ``[2F, H]``;
routed experts of all held MoE layers stacked as ``[Lm, El, 2F, H]`` and ``[Lm, El, H, F]``.
The family names every key.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.attention import AttentionKind, AttentionWeights, attention_for
from moeflow.model.checkpoint import CheckpointError, CheckpointReader
from moeflow.model.family import Family, family_for, load_families
from moeflow.model.moe import ExpertWeights
from moeflow.model.gate import GateWeights, gate_for, skewed


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # EngineConfig.dtype -> torch


@dataclass(frozen=True)
class LoadSpec:
    """Which part of the model a process holds."""

    layers: tuple[int, ...] | None = None  # None: every layer
    # routed experts held, one id per local slot; per held MoE layer where slots differ by layer; None: all
    experts: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    attention: bool = True  # embeddings, attention, norms, gate, dense MLPs, shared experts, LM head
    routed_experts: bool = True
    gates: bool = False  # without ``attention``: the gates alone (an AFD FFN daemon that routes)


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP, also the shape of a shared expert."""

    gate_up: torch.Tensor  # [2F, H]
    down: torch.Tensor  # [H, F]
    gate: torch.Tensor | None = None  # [1, H] sigmoid gate of a shared expert


@dataclass
class ModelWeights:
    embed: torch.Tensor | None = None  # [V, H]
    final_norm: torch.Tensor | None = None  # [H]
    lm_head: torch.Tensor | None = None  # [V, H] (the embedding itself when tied)
    attention: dict[int, AttentionWeights] = field(default_factory=dict)  # layer -> the attention kind's weights
    gates: dict[int, GateWeights] = field(default_factory=dict)  # layer -> its MoE gate
    dense: dict[int, MLPWeights] = field(default_factory=dict)
    shared: dict[int, MLPWeights] = field(default_factory=dict)
    experts: ExpertWeights | None = None


def load_config(path: str) -> tuple[ModelConfig, Family]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path} is not a Hugging Face model directory: config.json not found")
    with open(cfg_path) as f:
        hf = json.load(f)
    load_families()
    family = family_for(hf)
    return family.to_model_config(hf), family


class WeightReader(Protocol):
    """Key -> tensor in the reader's dtype on its device: a checkpoint (``CheckpointReader``) or random
    values of the shape asked (``random_weights.RandomReader``)."""

    dtype: torch.dtype
    device: torch.device

    def has(self, key: str) -> bool: ...

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def maybe(self, key: str, shape: tuple[int, ...], wanted: bool) -> torch.Tensor | None: ...


def load_weights(path: str, dtype: torch.dtype, spec: LoadSpec = LoadSpec(), device: torch.device | str = "cpu",
                 router_skew: float = 0.0) -> tuple[ModelConfig, ModelWeights]:
    """``spec``'s part of the checkpoint at ``path`` in ``dtype``, loaded straight onto ``device``;
    ``router_skew``: the benchmarks' Zipf tilt of every gate's selection (``gate.skewed``)."""
    cfg, fam = load_config(path)
    return cfg, assemble_weights(CheckpointReader(path, dtype, device), cfg, fam, spec, router_skew)


def assemble_weights(r: WeightReader, cfg: ModelConfig, fam: Family, spec: LoadSpec = LoadSpec(),
                     router_skew: float = 0.0) -> ModelWeights:
    """``spec``'s part of the model, each tensor read from ``r`` by the family's key names."""
    layers = tuple(range(cfg.num_layers)) if spec.layers is None else spec.layers
    for lid in layers:
        if not 0 <= lid < cfg.num_layers:
            raise ConfigError(f"layer {lid} out of range: the model has {cfg.num_layers} layers")
    w = ModelWeights()
    h = cfg.hidden_size
    if spec.attention:
        w.embed = r.get(fam.embed_key, (cfg.vocab_size, h))
        w.final_norm = r.get(fam.final_norm_key, (h,))
        if cfg.tie_word_embeddings and not r.has(fam.lm_head_key):
            w.lm_head = w.embed
        else:
            w.lm_head = r.get(fam.lm_head_key, (cfg.vocab_size, h))
        kind = attention_for(cfg)
        for lid in layers:
            _load_attention_side(r, fam, cfg, kind, lid, w)
    elif spec.gates:
        w.gates = {lid: _load_gate(r, fam, cfg, lid) for lid in layers if cfg.sparse_layers[lid]}
    w.gates = {lid: skewed(g, lid, router_skew) for lid, g in w.gates.items()}
    if spec.routed_experts and cfg.num_moe_layers:
        w.experts = _load_experts(r, fam, cfg, [l for l in layers if cfg.sparse_layers[l]], spec.experts)
    return w


def _load_attention_side(r: WeightReader, fam: Family, cfg: ModelConfig, kind: AttentionKind, lid: int,
                         w: ModelWeights) -> None:
    h = cfg.hidden_size
    w.attention[lid] = kind.load(r, fam.attention_prefix(lid), input_norm=r.get(fam.input_norm_key(lid), (h,)),
                                 post_norm=r.get(fam.post_norm_key(lid), (h,)))
    if cfg.sparse_layers[lid]:
        w.gates[lid] = _load_gate(r, fam, cfg, lid)
        fs = cfg.shared_expert_intermediate_size
        if fs:
            w.shared[lid] = MLPWeights(
                gate_up=torch.cat([r.get(fam.shared_expert_key(lid, "gate_proj"), (fs, h)),
                                   r.get(fam.shared_expert_key(lid, "up_proj"), (fs, h))]),
                down=r.get(fam.shared_expert_key(lid, "down_proj"), (h, fs)),
                gate=r.maybe(fam.shared_gate_key(lid), (1, h), cfg.shared_expert_gated))  # [1, H]
    else:
        f = cfg.intermediate_size
        w.dense[lid] = MLPWeights(
            gate_up=torch.cat([r.get(fam.dense_key(lid, "gate_proj"), (f, h)),
                               r.get(fam.dense_key(lid, "up_proj"), (f, h))]),
            down=r.get(fam.dense_key(lid, "down_proj"), (h, f)))


def _load_gate(r: WeightReader, fam: Family, cfg: ModelConfig, lid: int) -> GateWeights:
    fp32 = gate_for(cfg).fp32_weights
    bias_key = fam.gate_bias_key(lid)
    return GateWeights(r.get(fam.gate_key(lid), (cfg.num_experts, cfg.hidden_size), torch.float32 if fp32 else None),
                       r.get(bias_key, (cfg.num_experts,), torch.float32) if bias_key else None)


def _load_experts(r: WeightReader, fam: Family, cfg: ModelConfig, moe_layers: list[int],
                  experts: tuple | None) -> ExpertWeights:
    expert_ids = tuple(range(cfg.num_experts)) if experts is None else tuple(experts)
    per_layer = bool(expert_ids) and isinstance(expert_ids[0], tuple)
    slots = expert_ids if per_layer else (expert_ids,) * len(moe_layers)
    if len(slots) != len(moe_layers) or len({len(s) for s in slots}) > 1:
        raise ConfigError(f"experts per layer: {len(moe_layers)} MoE layers need as many slot lists of one length, "
                          f"got {[len(s) for s in slots]}")
    for e in {e for ids in slots for e in ids}:
        if not 0 <= e < cfg.num_experts:
            raise ConfigError(f"expert {e} out of range: the model has {cfg.num_experts} routed experts")
    h, f, el = cfg.hidden_size, cfg.moe_intermediate_size, len(slots[0]) if slots else 0
    w13 = torch.empty(len(moe_layers), el, 2 * f, h, dtype=r.dtype, device=r.device)  # [Lm, El, 2F, H]
    w2 = torch.empty(len(moe_layers), el, h, f, dtype=r.dtype, device=r.device)  # [Lm, El, H, F]
    for i, lid in enumerate(moe_layers):
        for j, e in enumerate(slots[i]):
            w13[i, j, :f] = r.get(fam.expert_key(lid, e, 0), (f, h))
            w13[i, j, f:] = r.get(fam.expert_key(lid, e, 1), (f, h))
            w2[i, j] = r.get(fam.expert_key(lid, e, 2), (h, f))
    return ExpertWeights(w13, w2, tuple(moe_layers), expert_ids)
