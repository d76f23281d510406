"""Grouped-query attention (Qwen2-MoE, Qwen3-MoE, Mixtral): optional q/k/v and o biases, optional
per-head q/k RMSNorm (Qwen3), rotate-half RoPE.

Layout: q/k/v fused per layer as one ``[(Hq + 2 Hkv) D, H]`` matrix, q rows first; each token
caches k and v of ``[Hkv, D]`` per layer. Under TP a member keeps Hq/size query heads and
Hkv/size kv heads (its rows of q, k and v and its columns of o); its output projection is a
partial sum. Legend: T tokens, H hidden, Hq / Hkv query / key-value heads, D head_dim.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.attention.base import AttentionKind, AttentionWeights, KVLayout
from moeflow.model.layers import attention_core, rms_norm
from moeflow.model.rope import Rotary

if TYPE_CHECKING:
    from moeflow.model.checkpoint import CheckpointReader
    from moeflow.model.kv_cache import AttentionMetadata, KVCache


@dataclass
class GQAWeights(AttentionWeights):
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None  # [H]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]


class GQA(AttentionKind):
    name = "gqa"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope, cfg.max_position_embeddings, cfg.rope_interleave)

    def kv_layout(self) -> KVLayout:
        c = self.cfg
        return {"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.head_dim)}

    def load(self, r: CheckpointReader, prefix: str, input_norm: torch.Tensor,
             post_norm: torch.Tensor) -> GQAWeights:
        c = self.cfg
        h, d, q, kv = c.hidden_size, c.head_dim, c.q_size, c.kv_size
        qkv = torch.cat([r.get(f"{prefix}q_proj.weight", (q, h)), r.get(f"{prefix}k_proj.weight", (kv, h)),
                         r.get(f"{prefix}v_proj.weight", (kv, h))])  # [(Hq + 2 Hkv) D, H]
        qkv_bias = None
        if c.qkv_bias:
            qkv_bias = torch.cat([r.get(f"{prefix}q_proj.bias", (q,)), r.get(f"{prefix}k_proj.bias", (kv,)),
                                  r.get(f"{prefix}v_proj.bias", (kv,))])  # [(Hq + 2 Hkv) D]
        return GQAWeights(
            input_norm=input_norm, post_norm=post_norm, qkv=qkv, qkv_bias=qkv_bias,
            o=r.get(f"{prefix}o_proj.weight", (h, q)),
            o_bias=r.maybe(f"{prefix}o_proj.bias", (h,), c.o_bias),
            q_norm=r.maybe(f"{prefix}q_norm.weight", (d,), c.qk_norm),
            k_norm=r.maybe(f"{prefix}k_norm.weight", (d,), c.qk_norm),
        )

    def check_tp(self, size: int) -> None:
        c = self.cfg
        if c.num_heads % size or c.num_kv_heads % size:
            raise ConfigError(f"attention TP size {size} must divide num_heads ({c.num_heads}) and "
                              f"num_kv_heads ({c.num_kv_heads})")

    def shard(self, w: GQAWeights, rank: int, size: int) -> GQAWeights:
        c = self.cfg
        d = c.head_dim
        hq, hkv = c.num_heads // size, c.num_kv_heads // size
        q0, k0 = rank * hq * d, rank * hkv * d
        q_rows = slice(q0, q0 + hq * d)
        k_rows = slice(c.q_size + k0, c.q_size + k0 + hkv * d)
        v_rows = slice(c.q_size + c.kv_size + k0, c.q_size + c.kv_size + k0 + hkv * d)

        def rows(t):  # this member's q, k and v rows of the fused qkv matrix (or bias)
            return None if t is None else torch.cat([t[q_rows], t[k_rows], t[v_rows]])

        return dataclasses.replace(w, qkv=rows(w.qkv), qkv_bias=rows(w.qkv_bias), o=w.o[:, q_rows].contiguous())

    def member_config(self, size: int) -> ModelConfig:
        c = self.cfg
        return dataclasses.replace(c, num_heads=c.num_heads // size, num_kv_heads=c.num_kv_heads // size)

    def rotaries(self) -> tuple:
        return (self.rotary,)

    def forward(self, w: GQAWeights, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
                layer: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        c = self.cfg
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        t = qkv.shape[0]
        q = qkv[:, :c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        self.fit_rotaries(meta)
        q = self.rotary(q, meta.positions)
        k = self.rotary(k, meta.positions)
        o = attention_core(q, k, v.contiguous(), meta, kv_cache, layer)  # [T, Hq, D]
        out = F.linear(o.reshape(t, c.q_size), w.o)  # [T, H] (a partial sum under TP)
        if reduce is not None:
            out = reduce(out)
        if w.o_bias is not None:  # NOTE: after the reduce, or every member would add it once
            out = out + w.o_bias
        return out
