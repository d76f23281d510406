"""Model FLOPs of a prefill, counted from the config (multiply-add = 2 FLOPs).

Counted: q/k/v/o projections (MLA: q_a/q_b or q, kv_a, kv_b's up-projection of every key as the
expanded prefill computes it, o), causal attention scores and values (s(s+1)/2 pairs per head;
DSA: the indexer's scores over every pair, attention over at most index_topk keys per query),
MoE gate, the K routed experts and any shared expert per token, dense MLP layers, and the LM head
for the rows whose logits are computed. Norms, rotary and softmax are left out (not GEMMs).
"""
from __future__ import annotations

from moeflow.config import ModelConfig


def _attention_flops(cfg: ModelConfig, seq_lens: list[int]) -> tuple[float, float]:
    """(projections, core) of one layer's attention over a prefill of ``seq_lens``."""
    h, tokens = cfg.hidden_size, sum(seq_lens)
    pairs = sum(s * (s + 1) / 2 for s in seq_lens)  # causal (query, key) pairs of one head
    if not cfg.kv_lora_rank:
        return 2 * tokens * h * (2 * cfg.q_size + 2 * cfg.kv_size), 2 * 2 * pairs * cfg.head_dim * cfg.num_heads
    n, dn, dr, dv, rkv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = h * cfg.q_lora_rank + cfg.q_lora_rank * n * (dn + dr) if cfg.q_lora_rank else h * n * (dn + dr)
    proj = 2 * tokens * (q + h * (rkv + dr) + rkv * n * (dn + dv) + n * dv * h)
    if cfg.index_topk:  # DSA: attention over the top-k keys, the indexer over every pair
        k = cfg.index_topk
        pairs_attended = sum(sum(min(i + 1, k) for i in range(s)) for s in seq_lens)
        proj += 2 * tokens * (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
                              + h * cfg.index_n_heads)
        return proj, 2 * pairs_attended * n * (dn + dr + dv) + 2 * pairs * cfg.index_n_heads * cfg.index_head_dim
    return proj, 2 * pairs * n * (dn + dr + dv)


def prefill_flops(cfg: ModelConfig, seq_lens: list[int], logits_rows: int | None = None) -> float:
    h = cfg.hidden_size
    tokens = sum(seq_lens)
    proj, attn = _attention_flops(cfg, seq_lens)
    total = 0.0
    for is_sparse in cfg.sparse_layers:
        total += proj + attn
        if is_sparse:
            total += 2 * tokens * h * cfg.num_experts  # MoE gate
            total += 2 * tokens * cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                total += 2 * tokens * 3 * h * cfg.shared_expert_intermediate_size
        else:
            total += 2 * tokens * 3 * h * cfg.intermediate_size
    rows = len(seq_lens) if logits_rows is None else logits_rows
    return total + 2 * rows * h * cfg.vocab_size
