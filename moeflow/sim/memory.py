"""The memory budget as the simulator sees it: KV-cache capacity per attention group, from the
device's budget minus what each process holds, for a model spec (no checkpoint, no torch).

The plan is the engine's own (``layout/memory.py``: what each process of a mode holds, the
activation reserve, the capacity); here the model's sizes come from a ``ModelSpec``: the attention
projections (split by TP), the rest of the attention side (embeddings, LM head, norms, shared
experts, dense MLPs; the gates apart, which an afd daemon that routes also holds), one routed
expert of every MoE layer, and the KV per token, in the spec's unquantized width for activations
and buffers. The capacity is counted in tokens.

Communication buffers, with ``engine_buffers``: the receive sides moeflow's engine allocates
(``layout/comm_spec.py``), sized for ``max_batch_tokens`` — what a simulation of this machine's
engine must count (a dep rank of tiny in float32 at 4096 tokens holds 0.5 GiB of them). Without it
none are counted: on NVLink they are the collective library's. A test holds the plan of the
embedded model to the engine's, read from its checkpoint, for every mode.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.experiment.system import HARDWARE_ROLES
from moeflow.layout import memory
from moeflow.layout.memory import GIB, ModelSizes, Process
from moeflow.sim.model_spec import ModelSpec

_DTYPE_OF_BYTES = {2: "bfloat16", 4: "float32"}


@dataclass(frozen=True)
class KvPlan:
    budget: float  # bytes per device
    reserve: float  # activation reserve per device
    kv_tokens: int  # KV-cache capacity of one attention group, in tokens
    devices: tuple[Process, ...]

    def to_dict(self) -> dict:
        return {"budget_gib": self.budget / GIB, "activation_reserve_gib": self.reserve / GIB, "kv_tokens": self.kv_tokens,
                "devices": [{"name": d.name, "weights_gib": d.weights / GIB, "buffers_gib": d.buffers / GIB,
                             "kv_cache_gib": self.kv_tokens * d.kv_per_token / GIB} for d in self.devices]}


def model_sizes(m: ModelSpec) -> ModelSizes:
    """The plan's sizes of ``m``."""
    attention = m.num_layers * m.attn_proj_params * m.weight_bytes
    routers = m.base_bytes * m.num_moe_layers * m.hidden_size * m.num_experts
    h, k = m.hidden_size, m.top_k if m.num_moe_layers else 0
    if m.attention == "gqa":
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    else:
        q, kv = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.kv_lora_rank + m.qk_rope_head_dim
    widest = max(m.dense_intermediate_size if m.num_dense_layers else 0, m.shared_intermediate_size)
    act = memory.activation_elements(h, k, q, kv, m.moe_intermediate_size, widest)
    return ModelSizes(attention, m.num_moe_layers * m.expert_bytes, routers, m.attention_side_bytes - attention - routers,
                      m.num_experts, m.num_moe_layers, m.kv_bytes_per_token_layer * m.num_layers, m.attention == "gqa",
                      h, m.top_k, _DTYPE_OF_BYTES[int(m.base_bytes)], act * m.base_bytes, m.vocab_size)


def plan_kv(m: ModelSpec, layout, budget_bytes: float, max_batch_tokens: int, max_num_seqs: int,
            reserve_bytes: float | None = None, hbm_bytes: float = 0.0, engine_buffers: bool = False,
            role_budgets: dict[str, float] | None = None) -> KvPlan:
    """KV capacity per attention group under ``budget_bytes`` per device (``role_budgets``: a role's
    own, on hardware of its own); clear errors when it does not fit. ``engine_buffers``: count
    moeflow's communication buffers with each device's fixed part."""
    if hbm_bytes and budget_bytes > hbm_bytes:
        raise ValueError(f"memory budget {budget_bytes / GIB:.1f} GiB per device exceeds the device's "
                         f"{hbm_bytes / GIB:.1f} GiB")
    sizes = model_sizes(m)
    reserve = memory.reserve(sizes, max_batch_tokens, max_num_seqs) if reserve_bytes is None else reserve_bytes
    devs = memory.processes(layout, sizes, buffers=engine_buffers)
    tokens = memory.kv_capacity(devs, budget_bytes, reserve, per="device", role_budgets=role_budgets)
    return KvPlan(budget_bytes, reserve, tokens, tuple(devs))


def role_budgets(spec, budget_bytes: float, hbm_of) -> dict[str, float] | None:
    """Each role of ``spec`` (a process's ``role``; "" for one without) on hardware of its own gets the
    share of its device's memory that ``budget_bytes`` is of the experiment's (``hbm_of(None)``)
    device: the budget read as vLLM's gpu_memory_utilization. None: no role differs."""
    if not spec.hardware:
        return None
    base, out = hbm_of(None), {}
    for role in ("", *HARDWARE_ROLES.get(spec.layout.mode, ())):
        name = spec.hardware_of(role or "all")
        if name is not None:
            if not base or not hbm_of(name):
                raise ValueError(f"system {spec.name!r}: hardware per role needs the memory (hbm_bytes) of the "
                                 f"experiment's preset and of {name!r} to size each role's budget")
            out[role] = budget_bytes * hbm_of(name) / base
    return out


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
