"""The MoE decoder as separately callable stages, in plain single-device PyTorch.

embed -> per layer {attention, route, experts, combine} (or a dense MLP) -> logits.
The runtime calls the stages one by one (possibly on different processes); ``forward`` chains
them for the colocated case. Shape legend: T tokens, H hidden, K experts per token, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moeflow.config import ModelConfig
from moeflow.model.attention import attention_for
from moeflow.model.kv_cache import AttentionMetadata, KVCache
from moeflow.model.layers import rms_norm, swiglu
from moeflow.model.moe import experts_grouped, experts_loop, plan_pairs, weighted_sum
from moeflow.model.paged_attention import uses_kernel
from moeflow.model.gate import gate_for
from moeflow.model.weights import ModelWeights


@dataclass
class AttentionOut:
    residual: torch.Tensor  # [T, H] hidden state after attention + residual
    moe_input: torch.Tensor  # [T, H] post-attention RMSNorm of ``residual`` (what the FFN reads)


class MoETransformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, use_grouped_experts: bool = True,
                 attn_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``attn_reduce`` sums the partial o-projection of tensor-parallel attention shards (the
        caller supplies the collective); None when this process holds every head."""
        self.cfg, self.w = cfg, weights
        self.attn_reduce = attn_reduce
        self.attn_kind = attention_for(cfg)
        self.gate_kind = gate_for(cfg)
        self._experts_op = experts_grouped if use_grouped_experts else experts_loop
        if weights.attention:  # build or load the decode attention kernel now, not in the first decode step
            uses_kernel(next(iter(weights.attention.values())).input_norm.device)

    # -- stages -------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] int64 -> [T, H]."""
        return F.embedding(token_ids, self.w.embed)

    def attention(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata,
                  kv_cache: KVCache | None) -> AttentionOut:
        """Input norm, the model's attention kind, residual add, then the post-attention norm. hidden: [T, H]."""
        eps, a = self.cfg.rms_norm_eps, self.w.attention[layer]
        x = rms_norm(hidden, a.input_norm, eps)
        residual = hidden + self.attn_kind.forward(a, x, meta, kv_cache, layer, self.attn_reduce)
        return AttentionOut(residual, rms_norm(residual, a.post_norm, eps))

    def route(self, layer: int, moe_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (top-k expert ids [T, K] int64, weights [T, K] float32)."""
        return self.gate_kind(moe_input, self.w.gates[layer])

    def experts(self, layer: int, moe_input: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum over the locally held experts of each token's top-k. -> [T, H]
        (tokens whose experts are all elsewhere get zeros)."""
        plan = plan_pairs(topk_ids, self.w.experts)
        y = self._experts_op(self.w.experts, layer, moe_input[plan.token_index], plan.counts)
        return weighted_sum(moe_input.shape[0], plan, y, topk_weights)

    def combine(self, layer: int, attn: AttentionOut, routed: torch.Tensor) -> torch.Tensor:
        """Routed expert sum + shared expert (if any) + residual. -> next layer's hidden [T, H]."""
        out = attn.residual + routed
        shared = self.w.shared.get(layer)
        if shared is not None:
            s = swiglu(attn.moe_input, shared.gate_up, shared.down)
            if shared.gate is not None:
                s = torch.sigmoid(F.linear(attn.moe_input, shared.gate)) * s
            out = out + s
        return out

    def dense_mlp(self, layer: int, attn: AttentionOut) -> torch.Tensor:
        d = self.w.dense[layer]
        return attn.residual + swiglu(attn.moe_input, d.gate_up, d.down)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head. hidden: [N, H] (only the rows whose logits are needed) -> [N, V] float32."""
        x = rms_norm(hidden, self.w.final_norm, self.cfg.rms_norm_eps)
        return F.linear(x, self.w.lm_head).float()

    # -- colocated chain ----------------------------------------------------------------------

    def layer(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None) -> torch.Tensor:
        attn = self.attention(layer, hidden, meta, kv_cache)
        if not self.cfg.sparse_layers[layer]:
            return self.dense_mlp(layer, attn)
        ids, wts = self.route(layer, attn.moe_input)
        return self.combine(layer, attn, self.experts(layer, attn.moe_input, ids, wts))

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None) -> torch.Tensor:
        """All layers on one process. token_ids: [T] -> final hidden states [T, H] (before the norm)."""
        h = self.embed(token_ids)
        for layer in range(self.cfg.num_layers):
            h = self.layer(layer, h, meta, kv_cache)
        return h
