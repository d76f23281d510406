"""A memory budget per process: the weight footprint read from checkpoint headers equals what
loading allocates; KV blocks are what is left; a process with no experts fits more; a budget too
small is refused with the numbers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moeflow.config import ConfigError, EngineConfig
from moeflow.engine.memory import GIB, activation_reserve, model_sizes, plan_memory
from moeflow.layout.memory import Process
from moeflow.model.footprint import kv_bytes_per_token, weight_footprint
from moeflow.model.kv_cache import KVCache
from moeflow.model.weights import LoadSpec, load_config, load_weights
from moeflow.workers.stages import _nbytes


@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe", "deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_footprint_is_what_loading_allocates(checkpoints, name, dtype):
    path = checkpoints(name).path
    cfg, fam = load_config(path)
    fp = weight_footprint(path, cfg, fam, dtype)
    _, w = load_weights(path, dtype)
    experts = w.experts.w13.nbytes + w.experts.w2.nbytes
    assert fp.experts(cfg.num_experts) == experts
    assert fp.attention_side() == _nbytes(w) - experts
    _, ffn = load_weights(path, dtype, LoadSpec(attention=False, experts=(0, 1), gates=True))
    assert fp.experts(2) + fp.routers == _nbytes(ffn)
    assert kv_bytes_per_token(cfg, dtype) == KVCache.for_model(cfg, 1, 1, dtype).bytes_per_token


def test_blocks_are_the_rest_of_the_budget():
    config = EngineConfig(memory_budget_gib=1.0, dtype="float32")
    block = 1 << 20  # bytes of one KV block of 16 tokens
    procs = [Process("rank0", GIB // 2, GIB // 8, block / 16), Process("ffn0", GIB // 2)]
    plan = plan_memory(config, procs, reserve=GIB // 8)
    assert plan.num_kv_blocks == (GIB - GIB // 2 - GIB // 8 - GIB // 8) // (1 << 20) == 256
    lighter = plan_memory(config, [Process("attention0", GIB // 8, GIB // 8, block / 16)], reserve=GIB // 8)
    assert lighter.num_kv_blocks == 640  # no experts held: more requests fit
    assert plan.to_dict()["processes"][0]["kv_cache_gib"] == 0.25


def test_a_budget_too_small_names_the_process_and_the_numbers():
    config = EngineConfig(memory_budget_gib=0.5)
    with pytest.raises(ConfigError, match=r"too small for ffn0: weights 0\.600 GiB"):
        plan_memory(config, [Process("a", 0, 0, 1), Process("ffn0", int(0.6 * GIB))], reserve=0)
    with pytest.raises(ConfigError, match="no room for one KV block"):
        plan_memory(config, [Process("a", GIB // 2 - 10, 0, (1 << 20) / 16)], reserve=0)
    with pytest.raises(ConfigError, match="memory_budget_gib must be None or a number > 0"):
        EngineConfig(memory_budget_gib=0)


def test_the_reserve_is_stated_and_overridable(checkpoints):
    path = checkpoints("qwen3").path
    cfg, fam = load_config(path)
    config = EngineConfig(max_num_seqs=4)
    sizes = model_sizes(cfg, weight_footprint(path, cfg, fam, torch.float32), "float32")
    r = activation_reserve(config, 100, sizes)
    per_token = 6 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + \
        cfg.num_experts_per_tok * (cfg.hidden_size + 2 * cfg.moe_intermediate_size)
    assert r == 100 * per_token * 4 + 4 * cfg.vocab_size * 4
    assert activation_reserve(dataclasses.replace(config, activation_reserve_gib=0.25), 100, sizes) == GIB // 4


@pytest.mark.parametrize("layout", [
    {"mode": "dep", "dp": 2, "max_batch_tokens": 4096, "chunked_prefill_size": 2048},
    {"mode": "afd", "micro_batches": 2, "max_batch_tokens": 4096, "chunked_prefill_size": 2048},
    {"mode": "afd", "attn_workers": 2, "ffn_workers": 2, "micro_batches": 3, "max_batch_tokens": 2048},
    {"mode": "asap", "attn_dp": 1, "moe_workers": 2, "budget": 4.0},
    {"mode": "dwdp", "dp": 2, "max_batch_tokens": 4096},
    {"mode": "colocated", "budget": 2.5}])
def test_the_simulators_memory_plan_is_the_engines(layout):
    """The simulator (no torch, no checkpoint) plans the embedded model's memory as the engine does
    (both call ``layout/memory.py``): from a model spec, the same weights, communication buffers,
    reserve and KV capacity per process as from the checkpoint's headers (float32 here)."""
    from moeflow.engine.llm import resolve_model
    from moeflow.engine.modes import plan_for
    from moeflow.layout import layout_from_dict
    from moeflow.layout.memory import batch_tokens
    from moeflow.sim.memory import plan_kv
    from moeflow.sim.model_spec import model_preset

    layout = dict(layout)
    config = EngineConfig(memory_budget_gib=layout.pop("budget", 1.5), dtype="float32")
    lay = layout_from_dict(layout)
    engine = plan_for(lay, resolve_model("tiny"), config)
    spec = model_preset("tiny").at_dtype("float32")
    batch = batch_tokens(lay, config.max_num_batched_tokens)
    sim = plan_kv(spec, lay, config.memory_budget_gib * GIB, batch, config.max_num_seqs, engine_buffers=True)
    assert sim.reserve == engine.reserve
    assert len(sim.devices) == len(engine.processes)
    for d, p in zip(sim.devices, engine.processes):
        assert d.name == p.name and d.buffers == pytest.approx(p.buffers, rel=1e-3), d.name
        assert d.weights == pytest.approx(p.weights, rel=1e-3), d.name
    assert sim.kv_tokens // config.kv_block_size == engine.num_kv_blocks


def test_the_plan_counts_every_expert_slot_and_the_second_buffer():
    """Redundant slots (and live rebalancing's second buffer) are weights: a budget that holds a
    rank's own experts refuses 16 more slots, naming the process, its slots and the sum."""
    from moeflow.engine.llm import resolve_model
    from moeflow.engine.memory import apply_budget
    from moeflow.layout import make_layout

    path = resolve_model("tiny")
    cfg = EngineConfig(dtype="float32", memory_budget_gib=0.6, activation_reserve_gib=0.1)
    fits = apply_budget(cfg, path, make_layout("dep", dp=4, max_batch_tokens=512))[1]
    assert fits.num_kv_blocks > 0
    with pytest.raises(ConfigError, match=r"too small for rank0 \(8 expert slots\): weights 0\.549 GiB"):
        apply_budget(cfg, path, make_layout("dep", dp=4, max_batch_tokens=512, num_redundant_experts=16))
    live = dataclasses.replace(cfg, enable_eplb=True)
    with pytest.raises(ConfigError, match=r"rank0 \(4 expert slots, two buffers for live rebalancing\)"):
        apply_budget(live, path, make_layout("dep", dp=4, max_batch_tokens=512))
