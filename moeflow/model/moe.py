"""Routers, the layer-oblivious experts op, and its loop-over-experts oracle.

Expert weights of all MoE layers sit in two stacked tensors, so "the experts of layer l" is an
index, not a Python object: a MoE worker runs whatever layer arrives with the same code path.

Shape legend: T tokens, K experts per token, P = T*K (token, expert) pairs, H hidden,
F expert intermediate size, Lm MoE layers held, El experts held locally.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from moeflow.config import ConfigError, ModelConfig


@dataclass
class RouterWeights:
    """One MoE layer's gate."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None = None  # [E] float32 selection bias (DeepSeek's e_score_correction_bias)


class Router(abc.ABC):
    """Picks each token's top-k experts and their weights."""

    name: ClassVar[str]  # the value of ModelConfig.router_kind
    fp32_weights: ClassVar[bool] = False  # keep the gate in float32 whatever the model dtype (as trained)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor, gate: RouterWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (ids [T, K] int64, weights [T, K] float32)."""


class SoftmaxTopK(Router):
    name = "softmax_topk"

    def __call__(self, x: torch.Tensor, gate: RouterWeights) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, gate.weight, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)


class SigmoidGroupTopK(Router):
    """DeepSeek-V3's router: sigmoid scores in float32; the selection bias decides *which* experts
    (never their weights); a group's score is the sum of its top-2 biased scores and only the best
    ``topk_group`` groups compete; weights are the unbiased scores of the chosen, renormalized when
    ``norm_topk_prob``, times ``routed_scaling_factor``."""

    name = "sigmoid_group"
    fp32_weights = True

    def __call__(self, x: torch.Tensor, gate: RouterWeights) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [T, E]
        choice = scores if gate.bias is None else scores + gate.bias
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


ROUTERS: dict[str, type[Router]] = {SoftmaxTopK.name: SoftmaxTopK, SigmoidGroupTopK.name: SigmoidGroupTopK}


def router_for(cfg: ModelConfig) -> Router:
    router = ROUTERS.get(cfg.router_kind)
    if router is None:
        raise ConfigError(f"unknown router kind {cfg.router_kind!r}; known: {sorted(ROUTERS)}")
    return router(cfg)


def route(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router. x: [T, H]; gate_w: [E, H] -> (ids [T, K] int64, weights [T, K] float32)."""
    probs = F.linear(x, gate_w).float().softmax(dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@dataclass
class ExpertWeights:
    """Routed experts of the MoE layers this process holds.

    ``expert_ids`` lists the global expert ids held, in local order; ``layer_ids`` the model
    layers held. Either may be a subset (a MoE worker loads only what it owns).
    """

    w13: torch.Tensor  # [Lm, El, 2F, H] gate rows then up rows
    w2: torch.Tensor  # [Lm, El, H, F]
    layer_ids: tuple[int, ...]  # model layer id of each stacked entry
    expert_ids: tuple[int, ...]  # global expert id of each local expert

    def __post_init__(self) -> None:
        self._layer_slot = {lid: i for i, lid in enumerate(self.layer_ids)}
        lut = torch.full((max(self.expert_ids, default=-1) + 1,), -1, dtype=torch.int64)
        lut[list(self.expert_ids)] = torch.arange(len(self.expert_ids))
        self.global_to_local = lut  # [max id + 1] int64, -1 where not held

    def layer_slot(self, layer: int) -> int:
        try:
            return self._layer_slot[layer]
        except KeyError:
            raise KeyError(f"experts of layer {layer} are not held here (held: {self.layer_ids})") from None

    def local_ids(self, global_ids: torch.Tensor) -> torch.Tensor:
        """Map global expert ids to local ones; -1 where this process does not hold the expert."""
        lut = self.global_to_local
        inside = global_ids < lut.numel()
        return torch.where(inside, lut[global_ids.clamp(max=lut.numel() - 1)], -1)


def experts_grouped(w: ExpertWeights, layer: int, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Run the experts of ``layer`` on rows already grouped by local expert.

    x_sorted: [N, H], rows of local expert 0 first, then 1, ...; counts: [El] int rows per expert.
    Returns [N, H] in the same order. One grouped GEMM per projection, no per-expert Python loop.
    """
    slot = w.layer_slot(layer)
    if not _grouped_mm_aligned(w):
        return experts_loop(w, layer, x_sorted, counts)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # [El]
    w13, w2 = w.w13[slot], w.w2[slot]  # [El, 2F, H], [El, H, F]
    gate_up = F.grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)  # [N, 2F]
    f = w2.shape[-1]
    h = F.silu(gate_up[:, :f]) * gate_up[:, f:]  # [N, F]
    return F.grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # [N, H]


def _grouped_mm_aligned(w: ExpertWeights) -> bool:
    # NOTE: grouped_mm needs every row stride to be a multiple of 16 bytes (H and F multiples of 8
    # in bf16); real checkpoints are, odd test shapes may not be.
    item = w.w13.element_size()
    return (w.w13.shape[-1] * item) % 16 == 0 and (w.w2.shape[-1] * item) % 16 == 0


def experts_loop(w: ExpertWeights, layer: int, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Oracle for ``experts_grouped``: one plain matmul per expert."""
    slot = w.layer_slot(layer)
    out = torch.empty_like(x_sorted)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = x_sorted[start:start + n]
            gate_up = xe @ w.w13[slot, e].T
            f = w.w2.shape[-1]
            out[start:start + n] = (F.silu(gate_up[:, :f]) * gate_up[:, f:]) @ w.w2[slot, e].T
        start += n
    return out


@dataclass
class ExpertPlan:
    """Which (token, k) pairs go to which local expert, in grouped order."""

    pair_index: torch.Tensor  # [N] int64 flat index t*K + k of each grouped row
    token_index: torch.Tensor  # [N] int64 token row of each grouped row
    counts: torch.Tensor  # [El] int64 rows per local expert


def plan_pairs(topk_ids: torch.Tensor, w: ExpertWeights) -> ExpertPlan:
    """Group the pairs whose expert is held locally by local expert id (stable order).

    topk_ids: [T, K] global ids. Pairs of experts not held here are left out.
    """
    k = topk_ids.shape[1]
    local = w.local_ids(topk_ids.reshape(-1))  # [P]
    held = torch.nonzero(local >= 0).squeeze(1)  # [N]
    local_held = local[held]
    order = torch.argsort(local_held, stable=True)
    pair_index = held[order]
    counts = torch.bincount(local_held, minlength=len(w.expert_ids))
    return ExpertPlan(pair_index, pair_index // k, counts)


def weighted_sum(num_tokens: int, plan: ExpertPlan, y_sorted: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter-add weight * expert output back per token. Returns [T, H] (accumulated in ``out``)."""
    if out is None:
        out = torch.zeros(num_tokens, y_sorted.shape[1], dtype=y_sorted.dtype)
    wts = topk_weights.reshape(-1)[plan.pair_index].to(y_sorted.dtype).unsqueeze(1)  # [N, 1]
    out.index_add_(0, plan.token_index, y_sorted * wts)
    return out
