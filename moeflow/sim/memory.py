"""The memory budget as the simulator sees it: KV-cache capacity per attention group, from the
device's budget minus what each process holds, for a model spec (no checkpoint, no torch).

It mirrors the engine's plan (``engine/memory.py``): every process gets the same budget; a process
with a KV cache gets what its weights and the activation reserve leave, and the tightest one sets
the blocks of all:

    kv_tokens = min over KV-holding devices of (budget - weights - reserve) / (KV bytes per token)

Weights per device, per mode: dep, the attention side (its 1/tp of the attention projections) and
1/(dp·tp) of the routed experts; afd, an attention instance holds the attention side only, an FFN
daemon its experts and no KV; dwdp, the attention side, its resident experts and two layers' slots
of pulled ones; asap, attention workers as afd's instances. The activation reserve is the engine's
estimate (the live tensors of one ``max_batch_tokens`` batch in one layer, bf16, plus float32 logits
of ``max_num_seqs`` rows). Communication buffers are not counted (the engine's are sized for this
machine's shared memory; on NVLink they are the collective library's).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.sim.model_spec import ModelSpec

GIB = 1 << 30
ACT_BYTES = 2  # activations in bf16


@dataclass(frozen=True)
class Device:
    name: str
    weights: float  # bytes
    kv_per_token: float  # bytes one cached token costs it (0: it holds no KV cache)


@dataclass(frozen=True)
class KvPlan:
    budget: float  # bytes per device
    reserve: float  # activation reserve per device
    kv_tokens: int  # KV-cache capacity of one attention group, in tokens
    devices: tuple[Device, ...]

    def to_dict(self) -> dict:
        return {"budget_gib": self.budget / GIB, "activation_reserve_gib": self.reserve / GIB, "kv_tokens": self.kv_tokens,
                "devices": [{"name": d.name, "weights_gib": d.weights / GIB,
                             "kv_cache_gib": self.kv_tokens * d.kv_per_token / GIB} for d in self.devices]}


def activation_reserve(m: ModelSpec, max_batch_tokens: int, max_num_seqs: int) -> float:
    """The engine's default reserve (``engine/memory.py``) in spec terms."""
    h, k = m.hidden_size, m.top_k if m.num_moe_layers else 0
    if m.attention == "gqa":
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    else:
        q, kv = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.kv_lora_rank + m.qk_rope_head_dim
    widest = max(m.dense_intermediate_size if m.num_dense_layers else 0, m.shared_intermediate_size)
    per_token = 6 * h + q + 2 * kv + k * (h + 2 * m.moe_intermediate_size) + 2 * widest
    return max_batch_tokens * per_token * ACT_BYTES + max_num_seqs * m.vocab_size * 4


def devices(m: ModelSpec, layout) -> list[Device]:
    """Every device of ``layout`` with what it holds."""
    kv = m.kv_bytes_per_token_layer * m.num_layers
    attention = m.num_layers * m.attn_proj_params * m.weight_bytes
    side, mode = m.attention_side_bytes, layout.mode
    if mode == "dep":
        tp, n = layout.tp, layout.dp * layout.tp
        per = side - attention + attention / tp + m.num_moe_layers * m.expert_bytes * m.num_experts / n
        return [Device(f"rank{r}", per, kv / (tp if m.attention == "gqa" else 1)) for r in range(layout.dp)]
    if mode == "afd":
        placement = layout.placement_of_experts(m.num_experts)
        return [*(Device(f"attention{i}", side, kv) for i in range(layout.attn_workers)),
                *(Device(f"ffn{j}", m.num_moe_layers * m.expert_bytes * len(ids), 0)
                  for j, ids in enumerate(placement))]
    if mode == "dwdp":
        return [Device(f"rank{r}", side + m.expert_bytes * (m.num_moe_layers * len(set(ids))
                                                            + 2 * (m.num_experts - len(set(ids)))), kv)
                for r, ids in enumerate(layout.resident(m.num_experts))]
    if mode == "asap":
        t = layout.attn_tp
        return [*(Device(f"attention{g}.{i}", side - attention + attention / t, kv / (t if m.attention == "gqa" else 1))
                  for g in range(layout.attn_dp) for i in range(t)),
                *(Device(f"moe{w}", m.num_moe_layers * m.expert_bytes * len(ids), 0)
                  for w, ids in enumerate(layout.placement(m.num_experts)))]
    raise ValueError(f"memory plan: mode {mode!r} has no device list in the simulator")


def plan_kv(m: ModelSpec, layout, budget_bytes: float, max_batch_tokens: int, max_num_seqs: int,
            reserve_bytes: float | None = None, hbm_bytes: float = 0.0) -> KvPlan:
    """KV capacity per attention group under ``budget_bytes`` per device; clear errors when it does not fit."""
    if hbm_bytes and budget_bytes > hbm_bytes:
        raise ValueError(f"memory budget {budget_bytes / GIB:.1f} GiB per device exceeds the device's "
                         f"{hbm_bytes / GIB:.1f} GiB")
    reserve = activation_reserve(m, max_batch_tokens, max_num_seqs) if reserve_bytes is None else reserve_bytes
    devs = devices(m, layout)
    for d in devs:
        if d.weights + reserve > budget_bytes:
            raise ValueError(f"memory budget {budget_bytes / GIB:.1f} GiB per device is too small for {d.name}: weights "
                             f"{d.weights / GIB:.1f} GiB + activation reserve {reserve / GIB:.1f} GiB")
    tokens = min(int((budget_bytes - d.weights - reserve) // d.kv_per_token) for d in devs if d.kv_per_token)
    return KvPlan(budget_bytes, reserve, tokens, tuple(devs))
