"""Layouts: one validated dataclass per mode that the engine, the command line and the simulator
all build from; an experiment file's ``systems:`` entry means one thing to both worlds."""
from __future__ import annotations

import argparse

import pytest
import yaml

from moeflow.config import ConfigError, SchedulerConfig
from moeflow.engine.args import add_engine_args, engine_kwargs, layout_flags, layout_kwargs
from moeflow.experiment.serve import parse_experiment
from moeflow.layout import LAYOUTS, AsapLayout, DepLayout, layout_from_dict, layout_to_dict, make_layout, parse_parts

EXPERIMENT = """
model: MODEL
dtype: float32
hardware: h200
workload: {kind: production, length_scale: 0.05, duration_s: 2, seed: 0}
systems:
  asap: {mode: asap, attn_dp: 1, moe_workers: 2, comm_threads: false, min_batch_tokens: 64,
         scheduler: {dual_batch: false}, engine: {num_kv_blocks: 64, max_num_seqs: 8}, sim: {comm_overlap: false}}
  dep: {mode: dep, dp: 2, placement: round_robin, chunked_prefill_size: 32, engine: {num_kv_blocks: 64}}
"""


def test_every_mode_has_a_layout_and_flat_keywords_reach_sub_configs():
    assert {"colocated", "dep", "asap"} <= set(LAYOUTS)
    a = make_layout("asap", attn_dp=2, min_batch_tokens=64, dual_batch=False)
    assert a == AsapLayout(attn_dp=2, scheduler=SchedulerConfig(min_batch_tokens=64, dual_batch=False))
    assert a.num_processes == 3 and a.num_groups == 2
    assert make_layout("dep", dp=4).num_processes == 4
    assert make_layout("asap", expert_placement=[[0, 1], [2]], moe_workers=2).expert_placement == ((0, 1), (2,))


def test_bad_layouts_name_the_problem():
    with pytest.raises(ConfigError, match="unknown mode 'tp'"):
        make_layout("tp")
    with pytest.raises(ConfigError, match=r"mode 'dep' has no option\(s\) \['attn_dp'\]"):
        make_layout("dep", attn_dp=2)
    with pytest.raises(ConfigError, match="dp must be a positive int"):
        DepLayout(dp=0)
    with pytest.raises(ConfigError, match="chunked_prefill_size must be in"):
        DepLayout(chunked_prefill_size=10**6)
    with pytest.raises(ConfigError, match="expert_placement lists 1 workers"):
        make_layout("asap", moe_workers=2, expert_placement=[[0]])
    with pytest.raises(ConfigError, match="unknown keys in systems.x"):
        layout_from_dict({"mode": "asap", "dp": 2}, "systems.x")


def _cli(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(argv))


def test_the_command_line_is_generated_from_the_layouts():
    kw = _cli(["--mode", "asap", "--attn-dp", "2", "--moe-workers", "3", "--no-comm-threads", "--no-split",
               "--min-batch-tokens", "64", "--max-batch-wait-s", "0.01"])
    layout = make_layout(kw.pop("mode"), **{k: v for k, v in kw.items() if k in
                                            {"attn_dp", "moe_workers", "comm_threads", "split_lone_batch",
                                             "min_batch_tokens", "max_batch_wait_s"}})
    assert layout == AsapLayout(attn_dp=2, moe_workers=3, comm_threads=False, scheduler=SchedulerConfig(
        min_batch_tokens=64, max_batch_wait_s=0.01, split_lone_batch=False))
    dep = _cli(["--mode", "dep", "--dp", "2", "--dp-placement", "round_robin", "--max-batch-tokens", "4096"])
    assert (dep["dp"], dep["placement"], dep["max_batch_tokens"]) == (2, "round_robin", 4096)
    with pytest.raises(ConfigError, match="--attn-dp: not an option of mode 'dep'"):
        _cli(["--mode", "dep", "--attn-dp", "2"])
    assert "tp" not in _cli(["--mode", "dep"])  # the simulator's field stays off the command line


@pytest.mark.parametrize("entry", [
    {"mode": "afd", "attn_workers": 2, "ffn_workers": 3, "topology": "all", "router": "ffn", "max_ffn_workers": 4,
     "max_attn_workers": 3, "overlap_scheduling": False, "chunked_prefill_size": 256},
    {"mode": "asap", "attn_dp": 2, "moe_workers": 3, "comm_threads": False, "min_batch_tokens": 64, "dual_batch": False},
    {"mode": "dep", "dp": 2, "placement": "round_robin", "max_batch_tokens": 4096},
    {"mode": "dwdp", "dp": 3, "max_dp": 4},
    {"mode": "colocated"},
    {"mode": "pd", "prefill": {"mode": "asap", "attn_dp": 2, "moe_workers": 1, "min_batch_tokens": 64},
     "decode": {"mode": "dep", "dp": 1, "max_batch_tokens": 2048}, "prefill_instances": 2, "max_decode_instances": 3}])
def test_a_layouts_flags_start_that_layout(entry):
    layout = layout_from_dict(entry)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(layout_flags(layout))
    given = layout_kwargs(args) | {side: parse_parts(getattr(args, side), side) for side in ("prefill", "decode")
                                   if getattr(args, side, None) is not None}  # pd's sides, as engine_kwargs reads them
    assert layout_from_dict({"mode": args.mode, **given}) == layout


def test_the_engine_and_the_simulator_build_the_same_layout_from_one_entry(checkpoints, tmp_path):
    from moeflow import LLM
    from moeflow.sim.run import build_cost, make_system

    path = checkpoints("qwen3").path
    exp = parse_experiment(yaml.safe_load(EXPERIMENT.replace("MODEL", path)))
    sim = parse_experiment(yaml.safe_load(EXPERIMENT.replace("MODEL", "qwen3-235b-a22b")))
    cost = build_cost(sim)
    for name in ("asap", "dep"):
        spec = exp.systems[name]
        assert layout_from_dict(layout_to_dict(spec.layout)) == spec.layout  # what result files record
        with LLM.from_system(spec) as llm:
            assert llm.layout == spec.layout == sim.systems[name].layout
            assert llm.config.num_kv_blocks == 64 and llm.config.dtype == "float32"
            system = make_system(sim.systems[name], cost)
            assert system.layout == llm.layout
            assert type(system.sched) is type(llm.engine.scheduler)  # the engine's own scheduler
    assert exp.systems["asap"].sim.comm_overlap is False and exp.systems["asap"].engine.max_num_seqs == 8
