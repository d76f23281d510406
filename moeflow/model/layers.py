"""RMSNorm, ragged attention over a paged KV cache, dense SwiGLU MLP (RoPE: ``rope.py``; decode
attention that reads the cache in place: ``paged_attention.py``).

Shape legend: T tokens in the batch (all requests concatenated, no padding), H hidden size,
Hq / Hkv query / key-value heads, D head_dim, F intermediate size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeflow.model.paged_attention import DecodeBatch, decode_attention

if TYPE_CHECKING:  # NOTE: kv_cache imports the attention kinds, which import this file
    from moeflow.model.kv_cache import AttentionMetadata, KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # NOTE: normalize in float32 and cast back before scaling, in Hugging Face's order, so bf16
    # results round the same way as transformers'.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: KVCache | None, layer: int) -> torch.Tensor:
    """Causal attention per request over a ragged batch.

    q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; returns [T, Hq, D].
    New k/v are written to the cache first. The decode requests (one token over cached context)
    go through one ``decode_attention`` call, which reads the cache in place; a prefill attends to
    itself, a chunk over cached context reads that context back through its block table.
    """
    if kv_cache is not None:
        kv_cache.write(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    decode = meta.decode
    if decode is not None:
        assert kv_cache is not None, "a request with cached context needs a KV cache"
        k_cache, v_cache = kv_cache.layer_entries(layer)  # [N, Hkv, D] each
        out[decode.rows] = decode_attention(q[decode.rows], k_cache, v_cache, decode)
    for i, (q_start, q_len, ctx_len) in enumerate(meta.iter_seqs()):
        if q_len == 0 or DecodeBatch.takes(q_len, ctx_len):
            continue
        # NOTE: SDPA takes its fused (flash) CPU kernel only for 4-D inputs; 3-D falls back to the
        # math path, ~5x slower at 2k tokens.
        qi = q[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if ctx_len == 0:
            ki = k[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
            vi = v[q_start:q_start + q_len].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        else:
            assert kv_cache is not None, "a request with cached context needs a KV cache"
            ki, vi = kv_cache.gather(layer, meta.context_slots(i))  # [ctx+q_len, Hkv, D]
            ki, vi = ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0)
            if qi.device.type == "cpu":
                oi = _context_then_causal(qi, ki, vi, ctx_len)
            else:
                # query j sits at absolute position ctx_len + j and sees keys 0..ctx_len + j
                kpos = torch.arange(ctx_len + q_len, device=qi.device)
                qpos = torch.arange(q_len, device=qi.device) + ctx_len
                mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)  # [q_len, ctx+q_len]
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
        out[q_start:q_start + q_len] = oi[0].transpose(0, 1)
    return out


def _context_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """A chunk over cached context: full attention to the context, causal over itself, merged by
    log-sum-exp. q: [1, Hq, n, D], k/v: [1, Hkv, ctx_len + n, D].

    The CPU flash kernel cannot skip fully masked blocks, so one masked call over ctx + n keys
    costs as much as attending the whole square; two unmasked calls cost ctx*n + n*n/2.
    """
    # NOTE: the LSE-returning kernel has no GQA support, so K/V are expanded to all query heads.
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_ctx, lse_ctx = flash(q, k[:, :, :ctx_len], v[:, :, :ctx_len], 0.0, False)
    o_new, lse_new = flash(q, k[:, :, ctx_len:], v[:, :, ctx_len:], 0.0, True)
    w_ctx = torch.sigmoid(lse_ctx - lse_new).unsqueeze(-1)  # e^a / (e^a + e^b), float32
    return (o_ctx.float() * w_ctx + o_new.float() * (1 - w_ctx)).to(q.dtype)


def attention_reference(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Slow oracle for one request: explicit softmax(QK^T)V in float32.

    q: [n, Hq, D] at positions ctx_len..ctx_len+n-1; k_all/v_all: [ctx_len+n, Hkv, D].
    """
    n, hq, d = q.shape
    group = hq // k_all.shape[1]
    k = k_all.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    v = v_all.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) / d ** 0.5  # [Hq, n, S]
    qpos = torch.arange(n, device=q.device).unsqueeze(1) + ctx_len
    kpos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v).to(q.dtype)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP. x: [T, H]; w_gate_up: [2F, H] (gate rows first); w_down: [H, F]."""
    gate_up = F.linear(x, w_gate_up)  # [T, 2F]
    f = w_down.shape[1]
    return F.linear(F.silu(gate_up[:, :f]) * gate_up[:, f:], w_down)  # [T, H]
