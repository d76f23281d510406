"""MemoryPlan: a per-process memory budget turned into KV-cache blocks (vLLM's
``gpu_memory_utilization``, as bytes per process).

Every process of a deployment gets the same budget. What it holds is fixed by the layout — its
weights (``model/footprint.py``), the communication buffers it owns, and an activation reserve —
and a process with a KV cache gets the rest as blocks:

    num_kv_blocks = min over KV-holding processes of (budget - weights - buffers - reserve) // block_bytes

so a process that holds no routed experts (an asap attention worker, an afd attention instance)
really fits more requests than a dep rank with the same budget. A process whose fixed part
exceeds the budget is refused with the numbers. Each mode's engine lists its processes
(each mode's module's ``footprint``, ``modes.FOOTPRINTS``).

The activation reserve, unless given, is what one batch of ``max_batch_tokens`` tokens keeps
alive inside one layer, in the compute dtype: the hidden state, residual, attention output, MoE
input and two temporaries (6 H), the q/k/v projections, K dispatched copies with their expert
intermediates (K (H + 2 F_moe)) and the widest dense or shared MLP intermediate (2 F), plus the
float32 logits of ``max_num_seqs`` sampled rows (prompt logprobs over whole prompts are not
reserved for). It is a stated estimate, not a measurement.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from moeflow.config import ConfigError, EngineConfig, ModelConfig
from moeflow.model.footprint import WeightFootprint, kv_bytes_per_token, weight_footprint
from moeflow.model.weights import TORCH_DTYPES, load_config

log = logging.getLogger("moeflow.memory")

GIB = 1 << 30


@dataclass(frozen=True)
class ProcessFootprint:
    """One process's fixed bytes and its KV cache's cost per block (0: it holds no KV cache)."""

    name: str  # e.g. "attention0", "ffn1", "rank2"
    weights: int
    buffers: int = 0  # communication buffers it owns (the receive sides)
    kv_block_bytes: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    reserve: int
    num_kv_blocks: int
    processes: tuple[ProcessFootprint, ...]

    def kv_bytes(self, p: ProcessFootprint) -> int:
        return self.num_kv_blocks * p.kv_block_bytes

    def to_dict(self) -> dict:
        return {"budget_gib": self.budget / GIB, "activation_reserve_gib": self.reserve / GIB,
                "num_kv_blocks": self.num_kv_blocks,
                "processes": [{"name": p.name, "weights_gib": p.weights / GIB, "buffers_gib": p.buffers / GIB,
                               "kv_cache_gib": self.kv_bytes(p) / GIB,
                               "free_gib": (self.budget - p.weights - p.buffers - self.reserve - self.kv_bytes(p)) / GIB}
                              for p in self.processes]}

    def describe(self) -> str:
        kv = [p for p in self.processes if p.kv_block_bytes]
        most = max(self.processes, key=lambda p: p.weights + p.buffers)
        return (f"memory budget {self.budget / GIB:.2f} GiB/process: {self.num_kv_blocks} KV blocks per attention "
                f"group ({self.kv_bytes(kv[0]) / GIB:.2f} GiB); largest fixed part {most.name} "
                f"{(most.weights + most.buffers) / GIB:.2f} GiB + reserve {self.reserve / GIB:.2f} GiB")


def activation_reserve(mc: ModelConfig, config: EngineConfig, max_batch_tokens: int, dtype_bytes: int) -> int:
    """The default reserve (see the module docstring), in bytes."""
    if config.activation_reserve_gib is not None:
        return int(config.activation_reserve_gib * GIB)
    h, k = mc.hidden_size, mc.num_experts_per_tok if mc.num_moe_layers else 0
    widest = max(mc.intermediate_size if not all(mc.sparse_layers) else 0, mc.shared_expert_intermediate_size or 0)
    per_token = 6 * h + mc.q_size + 2 * mc.kv_size + k * (h + 2 * mc.moe_intermediate_size) + 2 * widest
    return max_batch_tokens * per_token * dtype_bytes + config.max_num_seqs * mc.vocab_size * 4


def plan_memory(config: EngineConfig, processes: list[ProcessFootprint], reserve: int) -> MemoryPlan:
    """KV blocks per attention group under ``config.memory_budget_gib`` (which must be set)."""
    budget = int(config.memory_budget_gib * GIB)
    for p in processes:
        fixed = p.weights + p.buffers + reserve
        if fixed > budget:
            raise ConfigError(
                f"memory budget {config.memory_budget_gib:g} GiB per process is too small for {p.name}: weights "
                f"{p.weights / GIB:.3f} GiB + communication buffers {p.buffers / GIB:.3f} GiB + activation reserve "
                f"{reserve / GIB:.3f} GiB = {fixed / GIB:.3f} GiB")
    kv = [p for p in processes if p.kv_block_bytes]
    if not kv:
        raise ConfigError("memory plan: no process holds a KV cache")
    blocks = min((budget - p.weights - p.buffers - reserve) // p.kv_block_bytes for p in kv)
    if blocks < 1:
        tight = min(kv, key=lambda p: budget - p.weights - p.buffers)
        raise ConfigError(f"memory budget {config.memory_budget_gib:g} GiB per process leaves {tight.name} no room "
                          f"for one KV block ({tight.kv_block_bytes} bytes)")
    return MemoryPlan(budget, reserve, int(blocks), tuple(processes))


Processes = Callable[[WeightFootprint, int], list[ProcessFootprint]]
# a mode's ``footprint`` (its engine module's): (layout, model config, engine config) -> (max batch tokens, its processes)
Footprint = Callable[..., tuple[int, Processes]]


def apply_budget(config: EngineConfig, model_path: str, layout,
                 footprint: Footprint) -> tuple[EngineConfig, MemoryPlan | None]:
    """``config`` with ``num_kv_blocks`` from its memory budget (unchanged without one), and the plan.
    The mode's ``footprint`` lists its processes given the weight footprint and one KV block of the
    whole model (a TP member's is its share)."""
    if config.memory_budget_gib is None:
        return config, None
    mc, family = load_config(model_path)
    max_batch_tokens, processes = footprint(layout, mc, config)
    dtype = TORCH_DTYPES[config.dtype]
    block = config.kv_block_size * kv_bytes_per_token(mc, dtype)
    procs = processes(weight_footprint(model_path, mc, family, dtype), block)
    plan = plan_memory(config, procs, activation_reserve(mc, config, max_batch_tokens, dtype.itemsize))
    log.info(plan.describe())
    return dataclasses.replace(config, num_kv_blocks=plan.num_kv_blocks), plan
