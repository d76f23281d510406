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
estimate (the live tensors of one ``max_batch_tokens`` batch in one layer, in the spec's unquantized
width, plus float32 logits of ``max_num_seqs`` rows).

Communication buffers, with ``engine_buffers``: the receive sides moeflow's engine allocates
(``comm/spec.py``'s geometry: a dep rank both sides, an afd/asap attention process its combine
buffer, a daemon or MoE worker its dispatch buffer), sized for ``max_batch_tokens`` — what a
simulation of this machine's engine must count (a dep rank of tiny in float32 at 4096 tokens holds
0.5 GiB of them). Without it none are counted: on NVLink they are the collective library's.
A test holds the whole plan to the engine's (``engine/memory.py``) for every mode.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.sim.model_spec import ModelSpec

GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    weights: float  # bytes
    kv_per_token: float  # bytes one cached token costs it (0: it holds no KV cache)
    buffers: float = 0.0  # communication buffers it owns (bytes)


@dataclass(frozen=True)
class KvPlan:
    budget: float  # bytes per device
    reserve: float  # activation reserve per device
    kv_tokens: int  # KV-cache capacity of one attention group, in tokens
    devices: tuple[Device, ...]

    def to_dict(self) -> dict:
        return {"budget_gib": self.budget / GIB, "activation_reserve_gib": self.reserve / GIB, "kv_tokens": self.kv_tokens,
                "devices": [{"name": d.name, "weights_gib": d.weights / GIB, "buffers_gib": d.buffers / GIB,
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
    return max_batch_tokens * per_token * m.base_bytes + max_num_seqs * m.vocab_size * 4


def _rows(m: ModelSpec, tokens: int, local_experts: int) -> int:
    """One lane slot's rows: each token can reach min(K, experts held) of a rank's experts."""
    return min(m.top_k, local_experts) * tokens


def comm_buffers(m: ModelSpec, layout) -> dict[str, float]:
    """Bytes of the engine's receive buffers per device name (``comm/spec.py``: every slot sized
    for the worst case of its sender; two slots, afd max(2, m))."""
    h, b = m.hidden_size, m.base_bytes
    mode = layout.mode
    if mode == "dep":
        local = -(-m.num_experts // layout.dp)
        rows = _rows(m, layout.max_batch_tokens, local)
        return {f"rank{r}": 2 * (layout.dp * 2 * rows * h * b) for r in range(layout.dp)}  # dispatch + combine
    if mode == "afd":
        slots, s = max(2, layout.micro_batches), layout.max_batch_tokens
        local = max(len(ids) for ids in layout.experts_held(m.num_experts))
        rows = _rows(m, s, local)
        segment = s if layout.router == "ffn" else rows
        return {**{f"attention{i}": layout.ffn_workers * slots * segment * h * b for i in range(layout.attn_workers)},
                **{f"ffn{j}": layout.attn_workers * slots * rows * h * b for j in range(layout.ffn_workers)}}
    if mode == "asap":
        t = layout.attn_tp
        local = max(len(ids) for ids in layout.experts_held(m.num_experts))
        rows = _rows(m, -(-layout.scheduler.max_batch_tokens // t), local)
        return {**{f"attention{g}.{i}": layout.moe_workers * 2 * rows * h * b
                   for g in range(layout.attn_dp) for i in range(t)},
                **{f"moe{w}": layout.attn_dp * t * 2 * rows * h * b for w in range(layout.moe_workers)}}
    return {}  # dwdp: its pulled-expert slots are counted with its weights


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
        placement = layout.experts_held(m.num_experts)
        return [*(Device(f"attention{i}", side, kv) for i in range(layout.attn_workers)),
                *(Device(f"ffn{j}", m.num_moe_layers * m.expert_bytes * len(ids), 0)
                  for j, ids in enumerate(placement))]
    if mode == "dwdp":
        return [Device(f"rank{r}", side + m.expert_bytes * (m.num_moe_layers * len(set(ids))
                                                            + 2 * (m.num_experts - len(set(ids)))), kv)
                for r, ids in enumerate(layout.experts_held(m.num_experts))]
    if mode == "asap":
        t = layout.attn_tp
        return [*(Device(f"attention{g}.{i}", side - attention + attention / t, kv / (t if m.attention == "gqa" else 1))
                  for g in range(layout.attn_dp) for i in range(t)),
                *(Device(f"moe{w}", m.num_moe_layers * m.expert_bytes * len(ids), 0)
                  for w, ids in enumerate(layout.experts_held(m.num_experts)))]
    raise ValueError(f"memory plan: mode {mode!r} has no device list in the simulator")


def plan_kv(m: ModelSpec, layout, budget_bytes: float, max_batch_tokens: int, max_num_seqs: int,
            reserve_bytes: float | None = None, hbm_bytes: float = 0.0, engine_buffers: bool = False) -> KvPlan:
    """KV capacity per attention group under ``budget_bytes`` per device; clear errors when it does not fit.
    ``engine_buffers``: count moeflow's communication buffers with each device's fixed part."""
    if hbm_bytes and budget_bytes > hbm_bytes:
        raise ValueError(f"memory budget {budget_bytes / GIB:.1f} GiB per device exceeds the device's "
                         f"{hbm_bytes / GIB:.1f} GiB")
    reserve = activation_reserve(m, max_batch_tokens, max_num_seqs) if reserve_bytes is None else reserve_bytes
    devs = devices(m, layout)
    if engine_buffers:
        buffers = comm_buffers(m, layout)
        devs = [dataclasses.replace(d, buffers=buffers.get(d.name, 0.0)) for d in devs]
    for d in devs:
        if d.weights + d.buffers + reserve > budget_bytes:
            raise ValueError(f"memory budget {budget_bytes / GIB:.2f} GiB per device is too small for {d.name}: weights "
                             f"{d.weights / GIB:.2f} GiB + communication buffers {d.buffers / GIB:.2f} GiB + activation "
                             f"reserve {reserve / GIB:.2f} GiB")
    tokens = min(int((budget_bytes - d.weights - d.buffers - reserve) // d.kv_per_token) for d in devs if d.kv_per_token)
    return KvPlan(budget_bytes, reserve, tokens, tuple(devs))


def most_resident_experts(m: ModelSpec, layout, budget_bytes: float, kv_tokens: int, max_num_seqs: int,
                          hbm_bytes: float = 0.0) -> int:
    """The most experts per layer a dwdp rank can hold (DWDP §2: "when memory allows", more local
    experts mean less to pull) while its budget still leaves ``kv_tokens`` of KV cache."""
    def fits(per: int) -> bool:
        try:
            lay = dataclasses.replace(layout, experts_per_rank=per)
            return plan_kv(m, lay, budget_bytes, layout.max_batch_tokens, max_num_seqs, None, hbm_bytes).kv_tokens >= kv_tokens
        except ValueError:
            return False
    lo, hi = -(-m.num_experts // layout.dp), m.num_experts
    if not fits(lo):
        raise ValueError(f"memory budget {budget_bytes / GIB:.1f} GiB: a dwdp rank cannot hold even its "
                         f"{lo} experts per layer and {kv_tokens} tokens of KV")
    while lo < hi:  # the plan's KV shrinks as the resident experts grow: the last per that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
