"""Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank pair, keys and
values from one shared latent, and a KV cache that stores only that latent.

Per token and layer the cache holds ``[c_kv | k_rope]``: the normalized latent (kv_lora_rank) and
the one rope key all heads share (qk_rope_head_dim), already rotated — 576 values for DeepSeek-V3
instead of 2 x 128 heads x 192. Two ways to attend, equal in exact arithmetic (a test checks it):

- expanded (prefill and chunks): up-project the latents of every key with kv_b into per-head
  k_nope and v, concatenate the shared rope key, attend as usual;
- absorbed (decode, one query): fold kv_b's key half into the query (q_nope . W_UK) and its value
  half into the output (p . c_kv, then W_UV), so the cached latents are read as they are. The
  decode requests of a batch go through one ``decode_attention`` call that reads the latent cache
  in place (keys [c_kv | k_pe], values a view of c_kv); DSA keeps the per-request ``absorbed``.

Under TP a member keeps num_heads/size heads (its rows of q or q_b and kv_b, its columns of o);
the latent and the rope key are computed and cached whole by every member. Legend: T tokens, H
hidden, Hn heads, dn/dr/dv nope/rope/value head dims, Rq q rank, Rkv latent rank, S keys.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from moeflow.config import ConfigError, ModelConfig
from moeflow.model.attention.base import AttentionKind, AttentionWeights, KVLayout
from moeflow.model.layers import rms_norm
from moeflow.model.paged_attention import DecodeBatch, decode_attention
from moeflow.model.rope import Rotary, softmax_scale

if TYPE_CHECKING:
    from moeflow.model.checkpoint import CheckpointReader
    from moeflow.model.kv_cache import AttentionMetadata, KVCache

# NOTE: transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not
# config.rms_norm_eps (checked in modeling_deepseek_v3.py, transformers 5.x)
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAWeights(AttentionWeights):
    q: torch.Tensor | None  # [Hn (dn + dr), H] when q is not low-rank
    q_a: torch.Tensor | None  # [Rq, H]
    q_a_bias: torch.Tensor | None  # [Rq]
    q_a_norm: torch.Tensor | None  # [Rq]
    q_b: torch.Tensor | None  # [Hn (dn + dr), Rq]
    kv_a: torch.Tensor  # [Rkv + dr, H]
    kv_a_bias: torch.Tensor | None  # [Rkv + dr]
    kv_a_norm: torch.Tensor  # [Rkv]
    kv_b: torch.Tensor  # [Hn (dn + dv), Rkv]
    o: torch.Tensor  # [H, Hn dv]
    o_bias: torch.Tensor | None  # [H]


@dataclass
class Projected:
    """One batch's queries and latents, before attention."""

    q_nope: torch.Tensor  # [T, Hn, dn]
    q_pe: torch.Tensor  # [T, Hn, dr] rotated
    latent: torch.Tensor  # [T, Rkv + dr]: normalized c_kv, rotated k_pe
    q_resid: torch.Tensor | None  # [T, Rq] the normalized q latent (the DSA indexer reads it)
    extra: dict = dataclasses.field(default_factory=dict)  # what a subclass computes once per batch


class MLA(AttentionKind):
    name = "mla"
    decode_in_place = True  # decode reads the latent cache in place, one call per layer (paged_attention.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.dn, self.dr, self.dv, self.rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.rotary = Rotary(self.dr, cfg.rope_theta, cfg.rope, cfg.max_position_embeddings, cfg.rope_interleave)
        self.scale = softmax_scale(self.dn + self.dr, cfg.rope)

    def kv_layout(self) -> KVLayout:
        return {"latent": (self.rkv + self.dr,)}

    def load(self, r: CheckpointReader, prefix: str, input_norm: torch.Tensor,
             post_norm: torch.Tensor) -> MLAWeights:
        c = self.cfg
        h, hn, rq, bias = c.hidden_size, c.num_heads, c.q_lora_rank, c.attention_bias
        qk = hn * (self.dn + self.dr)
        return MLAWeights(
            input_norm=input_norm, post_norm=post_norm,
            q=r.maybe(f"{prefix}q_proj.weight", (qk, h), not rq),
            q_a=r.maybe(f"{prefix}q_a_proj.weight", (rq, h), bool(rq)),
            q_a_bias=r.maybe(f"{prefix}q_a_proj.bias", (rq,), bool(rq) and bias),
            q_a_norm=r.maybe(f"{prefix}q_a_layernorm.weight", (rq,), bool(rq)),
            q_b=r.maybe(f"{prefix}q_b_proj.weight", (qk, rq), bool(rq)),
            kv_a=r.get(f"{prefix}kv_a_proj_with_mqa.weight", (self.rkv + self.dr, h)),
            kv_a_bias=r.maybe(f"{prefix}kv_a_proj_with_mqa.bias", (self.rkv + self.dr,), bias),
            kv_a_norm=r.get(f"{prefix}kv_a_layernorm.weight", (self.rkv,)),
            kv_b=r.get(f"{prefix}kv_b_proj.weight", (hn * (self.dn + self.dv), self.rkv)),
            o=r.get(f"{prefix}o_proj.weight", (h, hn * self.dv)),
            o_bias=r.maybe(f"{prefix}o_proj.bias", (h,), bias),
        )

    def check_tp(self, size: int) -> None:
        if self.cfg.num_heads % size:
            raise ConfigError(f"attention TP size {size} must divide num_heads ({self.cfg.num_heads})")

    def shard(self, w: MLAWeights, rank: int, size: int) -> MLAWeights:
        hn = self.cfg.num_heads // size
        q_rows = slice(rank * hn * (self.dn + self.dr), (rank + 1) * hn * (self.dn + self.dr))
        kv_rows = slice(rank * hn * (self.dn + self.dv), (rank + 1) * hn * (self.dn + self.dv))
        o_cols = slice(rank * hn * self.dv, (rank + 1) * hn * self.dv)
        return dataclasses.replace(w, q=None if w.q is None else w.q[q_rows].contiguous(),
                                   q_b=None if w.q_b is None else w.q_b[q_rows].contiguous(),
                                   kv_b=w.kv_b[kv_rows].contiguous(), o=w.o[:, o_cols].contiguous())

    def member_config(self, size: int) -> ModelConfig:
        c = self.cfg
        return dataclasses.replace(c, num_heads=c.num_heads // size, num_kv_heads=c.num_kv_heads // size)

    # -- forward --------------------------------------------------------------------------------

    def rotaries(self) -> tuple:
        return (self.rotary,)

    def project(self, w: MLAWeights, x: torch.Tensor, positions: torch.Tensor) -> Projected:
        t, hn = x.shape[0], self.cfg.num_heads
        q_resid = None
        if w.q is not None:
            q = F.linear(x, w.q)  # [T, Hn (dn + dr)]
        else:
            q_resid = rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)  # [T, Rq]
            q = F.linear(q_resid, w.q_b)
        q = q.view(t, hn, self.dn + self.dr)
        kv = F.linear(x, w.kv_a, w.kv_a_bias)  # [T, Rkv + dr]
        c_kv = rms_norm(kv[:, :self.rkv], w.kv_a_norm, LATENT_NORM_EPS)
        k_pe = self.rotary(kv[:, None, self.rkv:], positions)[:, 0]  # [T, dr]: one key for all heads
        return Projected(q[..., :self.dn], self.rotary(q[..., self.dn:], positions),
                         torch.cat([c_kv, k_pe], dim=-1), q_resid)

    def cache_entries(self, w: MLAWeights, x: torch.Tensor, p: Projected, positions: torch.Tensor) -> tuple:
        """What the new tokens store, in layout order."""
        return (p.latent,)

    def selection(self, p: Projected, rows: slice, cached: tuple, ctx: int) -> torch.Tensor | None:
        """[n, S] bool: the keys the queries ``rows`` (at positions ctx..) may attend to beyond
        causality, given every key's cached entries (None: all of them; DSA narrows it)."""
        return None

    def forward(self, w: MLAWeights, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache | None,
                layer: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        t = x.shape[0]
        self.fit_rotaries(meta)
        p = self.project(w, x, meta.positions)
        entries = self.cache_entries(w, x, p, meta.positions)
        if kv_cache is not None:
            kv_cache.write(layer, meta.slot_mapping, *entries)
        o = x.new_empty(t, self.cfg.num_heads, self.dv)  # [T, Hn, dv]
        decode = meta.decode if self.decode_in_place else None
        if decode is not None:
            assert kv_cache is not None, "a request with cached context needs a KV cache"
            rows = decode.rows
            o[rows] = self.absorbed_paged(w, p.q_nope[rows], p.q_pe[rows], kv_cache.layer_entries(layer)[0], decode)
        for i, (start, n, ctx) in enumerate(meta.iter_seqs()):
            if n == 0 or (decode is not None and DecodeBatch.takes(n, ctx)):
                continue
            rows = slice(start, start + n)
            if ctx == 0:
                cached = tuple(e[rows] for e in entries)
            else:
                assert kv_cache is not None, "a request with cached context needs a KV cache"
                cached = kv_cache.gather(layer, meta.context_slots(i))  # each [ctx + n, *e]
            keep = self.selection(p, rows, cached, ctx)
            if n == 1 and ctx > 0:
                o[start] = self.absorbed(w, p.q_nope[start], p.q_pe[start], cached[0], keep)
            else:
                o[rows] = self.expanded(w, p.q_nope[rows], p.q_pe[rows], cached[0], ctx, keep)
        out = F.linear(o.reshape(t, self.cfg.num_heads * self.dv), w.o)  # [T, H] (a partial sum under TP)
        if reduce is not None:
            out = reduce(out)
        if w.o_bias is not None:  # NOTE: after the reduce, or every member would add it once
            out = out + w.o_bias
        return out

    def expanded(self, w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, ctx: int,
                 keep: torch.Tensor | None) -> torch.Tensor:
        """Queries [n, Hn, *] at positions ctx.. over latents [S, Rkv + dr] -> [n, Hn, dv]."""
        n, s, hn = q_nope.shape[0], latent.shape[0], self.cfg.num_heads
        kv = F.linear(latent[:, :self.rkv], w.kv_b).view(s, hn, self.dn + self.dv)  # [S, Hn, dn + dv]
        k = torch.cat([kv[..., :self.dn], latent[:, None, self.rkv:].expand(s, hn, self.dr)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, Hn, n, dn + dr]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, Hn, S, dn + dr]
        v = kv[..., self.dn:].transpose(0, 1).unsqueeze(0)  # [1, Hn, S, dv]
        if ctx == 0 and keep is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = torch.arange(s, device=q.device).unsqueeze(0) <= torch.arange(n, device=q.device).unsqueeze(1) + ctx
            if keep is not None:
                mask &= keep
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def absorbed(self, w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 keep: torch.Tensor | None) -> torch.Tensor:
        """One query [Hn, *] over latents [S, Rkv + dr], kv_b folded in -> [Hn, dv]."""
        hn = self.cfg.num_heads
        w_kv = w.kv_b.view(hn, self.dn + self.dv, self.rkv)
        c_kv, k_pe = latent[:, :self.rkv], latent[:, self.rkv:]  # [S, Rkv], [S, dr]
        q_lat = torch.einsum("hd,hdr->hr", q_nope, w_kv[:, :self.dn])  # [Hn, Rkv]
        scores = (q_lat @ c_kv.T + q_pe @ k_pe.T) * self.scale  # [Hn, S]
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = scores.float().softmax(-1).to(latent.dtype)
        return torch.einsum("hr,hvr->hv", probs @ c_kv, w_kv[:, self.dn:])  # [Hn, dv]

    def absorbed_paged(self, w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                       decode: DecodeBatch) -> torch.Tensor:
        """``absorbed`` for a batch's decode queries [B, Hn, *] over one layer's latent cache [N, Rkv + dr],
        read in place -> [B, Hn, dv]."""
        hn = self.cfg.num_heads
        w_kv = w.kv_b.view(hn, self.dn + self.dv, self.rkv)
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_kv[:, :self.dn])  # [B, Hn, Rkv]
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, Hn, Rkv + dr]: one dot product with [c_kv | k_pe]
        k = latents.unsqueeze(1)  # [N, 1, Rkv + dr]: one kv head that every query head shares
        v = latents[:, None, :self.rkv]  # [N, 1, Rkv]: c_kv, a view of the same rows
        o_lat = decode_attention(q, k, v, decode, self.scale)  # [B, Hn, Rkv]
        return torch.einsum("bhr,hvr->bhv", o_lat, w_kv[:, self.dn:])  # [B, Hn, dv]
