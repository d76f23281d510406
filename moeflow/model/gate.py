"""The MoE gate (vLLM's word; "router" is ``moeflow router``, the HTTP one): each token's top-k
experts and their weights, by the kind ``ModelConfig.gate_kind`` names.

Adding a gate kind = one ``GateKind`` subclass and one entry in ``GATE_KINDS``. Shape legend: T tokens,
H hidden, E experts, K experts per token, G expert groups.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from moeflow.config import ConfigError, ModelConfig


@dataclass
class GateWeights:
    """One MoE layer's gate."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None = None  # [E] float32 selection bias (DeepSeek's e_score_correction_bias)
    skew: torch.Tensor | None = None  # [E] float32 log-tilt of the selection, for benchmarks only (``skewed``)


def skewed(gate: GateWeights, layer: int, s: float, seed: int = 0) -> GateWeights:
    """``gate`` whose selection prefers experts by a Zipf(s) popularity: the expert of rank r (a
    permutation drawn per layer from ``seed``) has its selection probability scaled by (r + 1)^-s.
    Weights of the chosen experts stay the model's. For benchmarks that need a gate as skewed
    as a trained model's (``--router-skew``); it changes the model's outputs."""
    if s == 0:
        return gate
    # drawn on the CPU, so every process and device gets the same order
    gen = torch.Generator(device="cpu").manual_seed(seed * 100003 + layer)
    rank = torch.randperm(gate.weight.shape[0], generator=gen, device="cpu")
    tilt = -s * torch.log1p(rank.to(torch.float32))
    return GateWeights(gate.weight, gate.bias, tilt.to(gate.weight.device))


class GateKind(abc.ABC):
    """Picks each token's top-k experts and their weights."""

    name: ClassVar[str]  # the value of ModelConfig.gate_kind
    fp32_weights: ClassVar[bool] = False  # keep the gate in float32 whatever the model dtype (as trained)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor, gate: GateWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (ids [T, K] int64, weights [T, K] float32)."""


class SoftmaxTopK(GateKind):
    name = "softmax_topk"

    def __call__(self, x: torch.Tensor, gate: GateWeights) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, gate.weight, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob, gate.skew)


class SigmoidGroupTopK(GateKind):
    """DeepSeek-V3's gate: sigmoid scores in float32; the selection bias decides *which* experts
    (never their weights); a group's score is the sum of its top-2 biased scores and only the best
    ``topk_group`` groups compete; weights are the unbiased scores of the chosen, renormalized when
    ``norm_topk_prob``, times ``routed_scaling_factor``."""

    name = "sigmoid_group"
    fp32_weights = True

    def __call__(self, x: torch.Tensor, gate: GateWeights) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [T, E]
        choice = scores if gate.skew is None else scores * gate.skew.exp()
        choice = choice if gate.bias is None else choice + gate.bias
        if c.n_group > 1:
            t, per = choice.shape[0], c.num_experts // c.n_group
            group_scores = choice.view(t, c.n_group, per).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1], 1)
            mask = keep.unsqueeze(-1).expand(t, c.n_group, per).reshape(t, c.num_experts)  # [T, E]
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, K]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


GATE_KINDS: dict[str, type[GateKind]] = {SoftmaxTopK.name: SoftmaxTopK, SigmoidGroupTopK.name: SigmoidGroupTopK}


def gate_for(cfg: ModelConfig) -> GateKind:
    kind = GATE_KINDS.get(cfg.gate_kind)
    if kind is None:
        raise ConfigError(f"unknown gate kind {cfg.gate_kind!r}; known: {sorted(GATE_KINDS)}")
    return kind(cfg)


def route(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, norm_topk_prob: bool,
          skew: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k gate. x: [T, H]; gate_w: [E, H] -> (ids [T, K] int64, weights [T, K] float32)."""
    probs = F.linear(x, gate_w).float().softmax(dim=-1)  # [T, E]
    if skew is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    else:
        ids = torch.topk(probs.log() + skew, top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights
