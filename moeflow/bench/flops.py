"""Model FLOPs of a prefill, counted from the config (multiply-add = 2 FLOPs).

Counted: q/k/v/o projections, causal attention scores and values (s(s+1)/2 pairs per head),
router, the K routed experts and any shared expert per token, dense MLP layers, and the LM head
for the rows whose logits are computed. Norms, rotary and softmax are left out (not GEMMs).
"""
from __future__ import annotations

from moeflow.config import ModelConfig


def prefill_flops(cfg: ModelConfig, seq_lens: list[int], logits_rows: int | None = None) -> float:
    h, d = cfg.hidden_size, cfg.head_dim
    tokens = sum(seq_lens)
    pairs = sum(s * (s + 1) / 2 for s in seq_lens)  # causal (query, key) pairs of one head
    proj = 2 * tokens * h * (cfg.q_size + 2 * cfg.kv_size + cfg.q_size)
    attn = 2 * 2 * pairs * d * cfg.num_heads  # QK^T and PV
    total = 0.0
    for is_sparse in cfg.sparse_layers:
        total += proj + attn
        if is_sparse:
            total += 2 * tokens * h * cfg.num_experts  # router
            total += 2 * tokens * cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
            if cfg.shared_expert_intermediate_size:
                total += 2 * tokens * 3 * h * cfg.shared_expert_intermediate_size
        else:
            total += 2 * tokens * 3 * h * cfg.intermediate_size
    rows = len(seq_lens) if logits_rows is None else logits_rows
    return total + 2 * rows * h * cfg.vocab_size
