"""DeepSeek-V3.2's sparse attention (DSA): MLA whose every query attends only to the
``index_topk`` keys a lightning indexer scores highest, in prefill and in decode.

The indexer has its own small projections: queries from the q latent (wq_b, index_n_heads heads of
index_head_dim), one key per token (wk, then LayerNorm), per-head weights from the hidden state
(weights_proj); its rope (rotate-half, on the first qk_rope_head_dim dims) is the main attention's
cos/sin. index(q, s) = sum_h w_h relu(q_h . k_s / sqrt(Di)); each query keeps its top-k causal keys,
the earlier of two equal scores first, so prefill, chunks and decode keep the same keys.
Each token also caches its indexer key. transformers' reference computes the same scores in float32
without the Hadamard rotation and fp8 of DeepSeek's kernels (the rotation preserves dot products).
With at most ``index_topk`` keys every key is kept: below that length DSA is dense MLA.
Legend: n queries of one request, S its keys, Hi indexer heads, Di their dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeflow.model.attention.base import KVLayout
from moeflow.model.attention.mla import MLA, MLAWeights, Projected
from moeflow.model.rope import Rotary

if TYPE_CHECKING:
    from moeflow.model.checkpoint import CheckpointReader

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (LayerNorm) in transformers' DeepseekV32Indexer


@dataclass
class DSAWeights(MLAWeights):
    index_wq: torch.Tensor | None = None  # [Hi Di, Rq]
    index_wk: torch.Tensor | None = None  # [Di, H]
    index_k_norm: torch.Tensor | None = None  # [Di]
    index_k_norm_bias: torch.Tensor | None = None  # [Di]
    index_weights: torch.Tensor | None = None  # [Hi, H]


class DSA(MLA):
    name = "dsa"
    # NOTE: decode keeps the per-request gather: the indexer scores every cached index key anyway, and
    # attention reads only the index_topk latents it selects; the paged kernel has no selection.
    decode_in_place = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.hi, self.di, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        # the indexer rotates halves, unlike the main attention's interleaved pairs
        self.index_rotary = Rotary(self.dr, cfg.rope_theta, cfg.rope, cfg.max_position_embeddings, interleave=False)

    def kv_layout(self) -> KVLayout:
        return {**super().kv_layout(), "index_k": (self.di,)}

    def rotaries(self) -> tuple:
        return (*super().rotaries(), self.index_rotary)

    def load(self, r: CheckpointReader, prefix: str, input_norm: torch.Tensor, post_norm: torch.Tensor) -> DSAWeights:
        base = super().load(r, prefix, input_norm, post_norm)
        c, i = self.cfg, f"{prefix}indexer."
        return DSAWeights(**vars(base),
                          index_wq=r.get(f"{i}wq_b.weight", (self.hi * self.di, c.q_lora_rank)),
                          index_wk=r.get(f"{i}wk.weight", (self.di, c.hidden_size)),
                          index_k_norm=r.get(f"{i}k_norm.weight", (self.di,)),
                          index_k_norm_bias=r.get(f"{i}k_norm.bias", (self.di,)),
                          index_weights=r.get(f"{i}weights_proj.weight", (self.hi, c.hidden_size)))

    def cache_entries(self, w: DSAWeights, x: torch.Tensor, p: Projected, positions: torch.Tensor) -> tuple:
        t = x.shape[0]
        q = F.linear(p.q_resid, w.index_wq).view(t, self.hi, self.di)  # [T, Hi, Di]
        k = F.layer_norm(F.linear(x, w.index_wk), (self.di,), w.index_k_norm, w.index_k_norm_bias,
                         INDEX_NORM_EPS).unsqueeze(1)  # [T, 1, Di]
        q = torch.cat([self.index_rotary(q[..., :self.dr], positions), q[..., self.dr:]], dim=-1)
        k = torch.cat([self.index_rotary(k[..., :self.dr], positions), k[..., self.dr:]], dim=-1)[:, 0]
        p.extra["index_q"] = q
        p.extra["index_w"] = F.linear(x, w.index_weights).float() * self.hi ** -0.5  # [T, Hi]
        return (p.latent, k)

    def selection(self, p: Projected, rows: slice, cached: tuple, ctx: int) -> torch.Tensor | None:
        keys = cached[1]  # [S, Di]
        s = keys.shape[0]
        if s <= self.topk:
            return None  # every key is among the top-k
        q, wts = p.extra["index_q"][rows].float(), p.extra["index_w"][rows]  # [n, Hi, Di], [n, Hi]
        n = q.shape[0]
        scores = F.relu(torch.einsum("nhd,sd->nhs", q, keys.float()) * self.di ** -0.5)  # [n, Hi, S]
        index = torch.einsum("nh,nhs->ns", wts, scores)  # [n, S]
        dev = keys.device
        causal = torch.arange(s, device=dev).unsqueeze(0) <= torch.arange(n, device=dev).unsqueeze(1) + ctx  # [n, S]
        index = index.masked_fill(~causal, float("-inf"))
        # NOTE: not topk: its choice among equal scores (ReLU makes many exactly 0) depends on the
        # row's length, so a prefill row (masked tail) and a decode row (shorter) kept different keys.
        # A stable sort keeps the earliest of equal keys, whatever the row's length.
        chosen = index.sort(dim=-1, descending=True, stable=True).indices[:, :self.topk]  # [n, topk]
        return torch.zeros(n, s, dtype=torch.bool, device=dev).scatter_(1, chosen, True)
