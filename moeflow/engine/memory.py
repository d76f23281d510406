"""MemoryPlan: a per-process memory budget turned into KV-cache blocks (vLLM's
``gpu_memory_utilization``, as bytes per process), for a model read from its checkpoint.

What each process of a mode holds, the reserve and the capacity are ``layout/memory.py``'s (the
simulator's plan calls the same); here the model's sizes come from the checkpoint's headers
(``model/footprint.py``) and the capacity is counted in KV blocks.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from moeflow.config import EngineConfig, ModelConfig
from moeflow.layout import memory
from moeflow.layout.memory import GIB, ModelSizes, Process
from moeflow.model.attention import attention_for
from moeflow.model.footprint import WeightFootprint, kv_bytes_per_token, weight_footprint
from moeflow.model.weights import TORCH_DTYPES, load_config

log = logging.getLogger("moeflow.memory")


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    reserve: int
    num_kv_blocks: int
    block_size: int
    processes: tuple[Process, ...]

    def kv_bytes(self, p: Process) -> int:
        return int(self.num_kv_blocks * self.block_size * p.kv_per_token)

    def to_dict(self) -> dict:
        return {"budget_gib": self.budget / GIB, "activation_reserve_gib": self.reserve / GIB,
                "num_kv_blocks": self.num_kv_blocks,
                "processes": [{"name": p.name, "weights_gib": p.weights / GIB, "buffers_gib": p.buffers / GIB,
                               "kv_cache_gib": self.kv_bytes(p) / GIB,
                               "free_gib": (self.budget - p.weights - p.buffers - self.reserve - self.kv_bytes(p)) / GIB}
                              for p in self.processes]}

    def describe(self) -> str:
        kv = [p for p in self.processes if p.kv_per_token]
        most = max(self.processes, key=lambda p: p.weights + p.buffers)
        return (f"memory budget {self.budget / GIB:.2f} GiB/process: {self.num_kv_blocks} KV blocks per attention "
                f"group ({self.kv_bytes(kv[0]) / GIB:.2f} GiB); largest fixed part {most.name} "
                f"{(most.weights + most.buffers) / GIB:.2f} GiB + reserve {self.reserve / GIB:.2f} GiB")


def model_sizes(mc: ModelConfig, fp: WeightFootprint, dtype: str) -> ModelSizes:
    """The plan's sizes of ``mc`` loaded in ``dtype``, from its checkpoint's footprint."""
    tdtype = TORCH_DTYPES[dtype]
    widest = max(mc.intermediate_size if not all(mc.sparse_layers) else 0, mc.shared_expert_intermediate_size or 0)
    k = mc.num_experts_per_tok if mc.num_moe_layers else 0
    act = memory.activation_elements(mc.hidden_size, k, mc.q_size, mc.kv_size, mc.moe_intermediate_size, widest)
    whole, h = kv_bytes_per_token(mc, tdtype), mc.num_kv_heads
    # a member of h holds one KV head: its KV is 1/h of the whole where the cache splits by heads (GQA)
    split = h > 1 and kv_bytes_per_token(attention_for(mc).member_config(h), tdtype) * h == whole
    return ModelSizes(fp.attention_layers, fp.per_expert, fp.routers, fp.other, mc.num_experts, mc.num_moe_layers,
                      whole, split, mc.hidden_size, mc.num_experts_per_tok, dtype, act * tdtype.itemsize, mc.vocab_size)


def activation_reserve(config: EngineConfig, max_batch_tokens: int, sizes: ModelSizes) -> int:
    """The reserve: ``config``'s, or the default (``layout/memory.py``), in bytes."""
    if config.activation_reserve_gib is not None:
        return int(config.activation_reserve_gib * GIB)
    return int(memory.reserve(sizes, max_batch_tokens, config.max_num_seqs))


def plan_memory(config: EngineConfig, procs: list[Process], reserve: int) -> MemoryPlan:
    """KV blocks per attention group under ``config.memory_budget_gib`` (which must be set)."""
    budget = int(config.memory_budget_gib * GIB)
    blocks = memory.kv_capacity(procs, budget, reserve, config.kv_block_size)
    return MemoryPlan(budget, reserve, blocks, config.kv_block_size, tuple(procs))


def apply_budget(config: EngineConfig, model_path: str, layout) -> tuple[EngineConfig, MemoryPlan | None]:
    """``config`` with ``num_kv_blocks`` from its memory budget (unchanged without one), and the plan."""
    if config.memory_budget_gib is None:
        return config, None
    mc, family = load_config(model_path)
    sizes = model_sizes(mc, weight_footprint(model_path, mc, family, TORCH_DTYPES[config.dtype]), config.dtype)
    procs = memory.processes(layout, sizes, eplb=config.enable_eplb)
    reserve = activation_reserve(config, memory.batch_tokens(layout, config.max_num_batched_tokens), sizes)
    plan = plan_memory(config, procs, reserve)
    log.info(plan.describe())
    return dataclasses.replace(config, num_kv_blocks=plan.num_kv_blocks), plan
