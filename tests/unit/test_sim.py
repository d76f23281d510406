"""The simulator: event order, determinism, the cost model's limits, closed-form single requests,
configs, and that it drives the engine's own schedulers."""
from __future__ import annotations

import json
import math

import pytest

from moeflow.experiment.serve import parse_experiment as parse_config
from moeflow.experiment.system import system_from_dict
from moeflow.measure.slo import MEAN, StopRule
from moeflow.measure.workload import WorkloadRequest
from moeflow.scheduler.asap import AsapScheduler
from moeflow.scheduler.dep import DepScheduler
from moeflow.sim.asap import AsapSystem
from moeflow.sim.cost import AnalyticCost
from moeflow.sim.dep import DepSystem
from moeflow.sim.events import EventLoop
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset
from moeflow.sim.run import build_cost, run_point, run_system
from moeflow.sim.shape import AttnShape

SCHED = {"min_batch_tokens": 256, "max_batch_tokens": 8192, "max_batch_wait_s": 0.01, "long_prompt_tokens": 4096}


# KV capacity nobody reaches here: 1M tokens per group, 1024 sequences
LIMITS = {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024}


def _cfg(**systems) -> object:
    systems = systems or {"dep": {"mode": "dep", "dp": 4, "max_batch_tokens": 8192},
                          "asap": {"mode": "asap", "attn_dp": 2, "moe_workers": 2, "scheduler": SCHED}}
    return parse_config({"model": "qwen3-235b-a22b", "hardware": "h200", "rps": [2, 8], "slo_ttft_s": 1.0,
                         "workload": {"kind": "production", "length_scale": 0.25, "duration_s": 20, "seed": 3},
                         "systems": {n: {"engine": LIMITS, **d} for n, d in systems.items()}})


def test_events_run_in_time_then_insertion_order_and_never_in_the_past():
    loop, seen = EventLoop(), []
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")]:
        loop.at(t, seen.append, name)
    loop.run()
    assert seen == ["a", "b", "c", "d"] and loop.now == 2.0 and loop.num_events == 4
    with pytest.raises(ValueError, match="before now"):
        loop.at(1.5, seen.append, "late")


def test_same_config_same_result():
    cfg = _cfg()
    cost = build_cost(cfg)
    for name in cfg.systems:
        a = run_system(name, cfg, cost, cfg.rps, find_slo=True).result
        b = run_system(name, cfg, cost, cfg.rps, find_slo=True).result
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        assert a["points"][0]["completed"] > 0 and a["slo_rps"] is not None


def test_sparse_pairs_match_brute_force():
    for start, n, cap in [(0, 10, 4), (3, 9, 4), (6, 5, 4), (0, 3, 8), (100, 50, 0)]:
        brute = sum(min(p + 1, cap) if cap else p + 1 for p in range(start, start + n))
        s = AttnShape.of([(start, n, True)], cap)
        assert s.num_sparse_pairs == brute
        assert s.num_pairs == sum(p + 1 for p in range(start, start + n))


def test_cost_model_limits():
    cost = AnalyticCost(model_preset("deepseek-v3.2"), hardware_preset("ascend-910c-die"))
    hw = cost.hw
    assert cost.roof.op_s(0, 0) == hw.launch_s
    assert cost.transfer_s(0) == hw.link_latency_s
    assert cost.transfer_s(1e9) == pytest.approx(hw.link_latency_s + 1e9 / (hw.link_bw_Bps * hw.link_eff))
    # experts: flat while the weights' bytes dominate, then linear in the tokens (ASAP Fig. 3b)
    small, small2 = cost.experts_s(64, 16), cost.experts_s(128, 16)
    big, big2 = cost.experts_s(1 << 17, 16), cost.experts_s(1 << 18, 16)
    assert small2 / small < 1.05 and big2 / big == pytest.approx(2, rel=0.01)
    assert cost.experts_s(0, 16) == 0.0
    # attention follows the pairs, not the tokens: same 32k tokens, one prompt costs more
    one = cost.attention_s(AttnShape.of([(0, 32768, True)], 2048), 1, False)
    many = cost.attention_s(AttnShape.of([(0, 1024, True)] * 32, 2048), 1, False)
    assert one > 2 * many
    # tensor parallelism splits the work (and adds an all-reduce)
    assert cost.attention_s(AttnShape.of([(0, 8192, True)], 2048), 4, False) < one / 4


def test_the_experts_inflection_is_where_their_flops_pass_their_weights_read():
    """The MoE efficiency curve (ASAP §2.2.2): flat while every local expert's weights are read
    for few tokens, linear once the FLOPs at the cited peak x gemm_eff take longer than that read
    at the HBM's cited rate; the bend sits where the two are equal, nothing fitted."""
    cost = AnalyticCost(model_preset("deepseek-v3.2"), hardware_preset("ascend-910c-die"))
    m, hw, local = cost.model, cost.hw, 8  # EP32: 256 experts, 8 per die
    flops_per_pair = 2 * m.expert_params / (cost.roof.peak(cost.expert_low) * hw.gemm_eff)
    bytes_per_pair = m.hidden_size * (m.act_bytes + 2) / (hw.mem_bw_Bps * hw.mem_eff)
    weights = local * m.expert_bytes / (hw.mem_bw_Bps * hw.mem_eff)
    ridge = weights / (flops_per_pair - bytes_per_pair)  # routed pairs on the die (all 8 experts active)
    assert 2500 < ridge < 3500  # ~ 11.4k tokens of a batch at top-8 over 32 dies: the row's 11.7k
    below, above = int(ridge * 0.9), int(ridge * 1.1)
    assert cost.experts_s(below, local) == pytest.approx(hw.launch_s + cost.experts_work(below, local)[1]
                                                         / (hw.mem_bw_Bps * hw.mem_eff), rel=1e-12)
    assert cost.experts_s(above, local) == pytest.approx(hw.launch_s + above * flops_per_pair, rel=1e-12)


def test_a_lone_request_takes_the_closed_form_time():
    cfg = _cfg()
    cost = build_cost(cfg)
    m, n = cost.model, 3000
    shape = AttnShape.of([(0, n, True)])
    dep_cfg = system_from_dict("d", {"mode": "dep", "dp": 4, "max_batch_tokens": 8192, "engine": LIMITS,
                                     "sim": {"compute_jitter_cv": 0.0}})  # jitter off: the closed form
    rec = DepSystem(dep_cfg, cost).run([WorkloadRequest(0.0, n, 1)]).records[0]
    moved = 3 / 4
    layer = (cost.attention_s(shape, 1, False) + cost.all_to_all_s(cost.dispatch_bytes(n) * moved)
             + cost.experts_s(round(n * m.top_k / 4), m.num_experts // 4)
             + cost.all_to_all_s(cost.combine_bytes(n) * moved))
    assert rec.ttft_s == pytest.approx(cost.head_s(shape, 1) + m.num_layers * layer)
    sched = dict(SCHED, max_batch_wait_s=0.0, split_lone_batch=False)
    asap_cfg = system_from_dict("a", {"mode": "asap", "attn_dp": 1, "moe_workers": 2, "scheduler": sched,
                                      "engine": LIMITS, "sim": {"compute_jitter_cv": 0.0}})
    sim = AsapSystem(asap_cfg, cost)
    rec = sim.run([WorkloadRequest(0.0, n, 1)]).records[0]
    bw = cost.link_bw_Bps
    layer = (cost.attention_s(shape, 1, False) + cost.dispatch_bytes(n) / 2 / bw + 2 * cost.transfer_s(0)
             + cost.experts_s(round(n * m.top_k / 2), m.num_experts // 2) + cost.combine_bytes(n) / 2 / bw)
    assert rec.ttft_s == pytest.approx(cost.head_s(shape, 1) + m.num_layers * layer)
    assert isinstance(sim.sched, AsapScheduler)


def test_the_engine_schedulers_drive_the_simulation():
    cfg = _cfg()
    cost = build_cost(cfg)
    assert isinstance(DepSystem(cfg.systems["dep"], cost).sched, DepScheduler)
    assert isinstance(AsapSystem(cfg.systems["asap"], cost).sched, AsapScheduler)


def test_each_asap_optimization_raises_slo_throughput():
    base = {"mode": "asap", "attn_dp": 2, "moe_workers": 2, "scheduler": SCHED}
    cfg = _cfg(asap=base, no_overlap={**base, "comm_threads": False}, no_super_kernel={**base, "sim": {"super_kernel": False}},
               no_dual={**base, "scheduler": {**SCHED, "dual_batch": False}})
    cost = build_cost(cfg)
    slo = {n: run_system(n, cfg, cost, cfg.rps, find_slo=True).result["slo_rps"] for n in cfg.systems}
    for ablation in ("no_overlap", "no_super_kernel", "no_dual"):
        assert slo[ablation] < slo["asap"], slo


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown keys in systems.x"):
        _cfg(x={"mode": "dep", "dpp": 2})
    with pytest.raises(ValueError, match="mode must be one of"):
        _cfg(x={"mode": "tp"})
    with pytest.raises(ValueError, match="missing 'workload'"):
        parse_config({"model": "tiny", "hardware": "h200", "systems": {"a": {"mode": "asap"}}})
    with pytest.raises(ValueError, match="unknown model preset"):
        build_cost(parse_config({"model": "gpt", "hardware": "h200", "workload": {"duration_s": 1},
                                 "systems": {"a": {"mode": "asap"}}}))
    with pytest.raises(ValueError, match="unknown fields"):
        hardware_preset("h200").with_overrides(flopz=1)


def test_tiny_preset_matches_the_embedded_model():
    from moeflow.model.tiny import TINY_HF_CONFIG as c

    m = model_preset("tiny")
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts,
            m.top_k, m.moe_intermediate_size) == (
        c["num_hidden_layers"], c["hidden_size"], c["vocab_size"], c["num_attention_heads"],
        c["num_key_value_heads"], c["head_dim"], c["num_experts"], c["num_experts_per_tok"],
        c["moe_intermediate_size"])


def test_simulating_stops_early_once_the_slo_is_lost():
    cfg = _cfg()
    cost = build_cost(cfg)
    res, _ = run_point(cfg.systems["dep"], cost, cfg, 200.0, stop=StopRule(MEAN, 1.0))
    assert res.get("stopped_early") and res["completed"] < 4000 and res["ttft_mean_s"] > 0 and math.isfinite(res["ttft_mean_s"])


def test_simulate_cli_writes_schema_plot_trace_and_compares(tmp_path, capsys):
    from moeflow.cli import main

    machine = tmp_path / "machine.json"  # what `moeflow env --json` reports (the figures of an AVX-512 machine)
    machine.write_text(json.dumps({"auto_dtype": "bfloat16", "memcpy_gbps": 20.0, "shm_flag_round_trip_us": 10.0,
                                   "gemm": {"bfloat16": {"gflops": 208.0}, "float32": {"gflops": 110.0}}}))
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("""
model: tiny
hardware: cpu-here
machine: MACHINE
workload: {kind: production, length_scale: 0.1, duration_s: 10, seed: 0}
rps: [0.5, 1]
slo_ttft_s: 2
systems:
  dep: {mode: dep, dp: 2}
  asap: {mode: asap, attn_dp: 1, moe_workers: 1}
""".replace("MACHINE", str(machine)))
    out, png, trace = tmp_path / "o.json", tmp_path / "o.png", tmp_path / "t.json"
    assert main(["simulate", "--config", str(cfg), "--find-slo-rps", "--json", str(out), "--plot", str(png),
                 "--trace", str(trace), "--trace-window-s", "20"]) == 0
    data = json.loads(out.read_text())
    assert set(data["systems"]) == {"dep", "asap"}
    for r in data["systems"].values():
        assert {"mode", "config", "workload", "slo_ttft_s", "slo_rps", "points"} <= set(r)
        assert {"rps", "completed", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefill_tok_s",
                "buckets"} <= set(r["points"][0])
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "M"}
    assert any(n.startswith("asap:attn0") for n in names) and any(n.startswith("dep:rank1") for n in names)
    assert png.stat().st_size > 0 and "SLO throughput" in capsys.readouterr().out
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(data["systems"]["asap"]))
    assert main(["simulate", "--config", str(cfg), "--system", "asap", "--find-slo-rps",
                 "--compare", f"asap={measured}", "--json", str(out)]) == 0
    assert "+0.0%" in capsys.readouterr().out
    assert json.loads(out.read_text())["comparison"]["asap"]["slo_error"] == 0.0
    assert main(["bench", "plot", str(out), "--out", str(png)]) == 0
    assert main(["simulate", "--config", str(cfg), "--system", "nope"]) == 2


def test_the_model_spec_comes_from_the_engines_model_config(checkpoints):
    from moeflow.model.weights import load_config
    from moeflow.sim.model_spec import ModelSpec

    path = checkpoints("qwen2_moe").path  # a dense layer and a shared expert
    mc, _ = load_config(path)
    spec = model_preset(path)  # a local checkpoint directory: its config.json, through the family
    assert spec == ModelSpec.from_model_config(spec.name, mc)
    assert (spec.num_layers, spec.num_dense_layers, spec.num_experts, spec.top_k) == (3, 1, 8, 2)
    assert spec.shared_intermediate_size == mc.shared_expert_intermediate_size == 48
    q = model_preset("qwen3-235b-a22b")  # the preset is Qwen3-235B-A22B's config.json
    assert (q.num_layers, q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim, q.num_experts, q.top_k,
            q.moe_intermediate_size) == (94, 4096, 64, 4, 128, 128, 8, 1536)


def test_afd_lone_request_closed_form_and_micro_batches_overlap():
    from moeflow.core import Request, SamplingParams
    from moeflow.scheduler.afd import AfdScheduler
    from moeflow.sim.afd import AfdSystem
    from moeflow.sim.system import _Track

    cfg = _cfg()
    cost = build_cost(cfg)
    m, n = cost.model, 3000
    shape = AttnShape.of([(0, n, True)])
    spec = system_from_dict("f", {"mode": "afd", "micro_batches": 1, "max_batch_tokens": 8192, "engine": LIMITS})
    sim = AfdSystem(spec, cost)
    rec = sim.run([WorkloadRequest(0.0, n, 1)]).records[0]
    layer = (cost.attention_s(shape, 1, False) + cost.transfer_s(cost.dispatch_bytes(n))
             + cost.experts_s(n * m.top_k, m.num_experts) + cost.transfer_s(cost.combine_bytes(n)))
    dense = cost.attention_s(shape, 1, True)
    assert rec.ttft_s == pytest.approx(cost.head_s(shape, 1) + m.num_moe_layers * layer + m.num_dense_layers * dense)
    assert isinstance(sim.sched, AfdScheduler)
    # two requests in one step: one micro-batch's experts run while the other's attention does
    ends = {}
    for ub in (1, 2):
        s = AfdSystem(system_from_dict("f", {"mode": "afd", "micro_batches": ub, "max_batch_tokens": 8192,
                                             "engine": LIMITS}), cost)
        for i in range(2):
            s.sched.add(Request(f"r{i}", range(n), SamplingParams(max_tokens=1, ignore_eos=True)))
            s.track[f"r{i}"] = _Track(0.0)
        s._step()
        s.loop.run()
        ends[ub] = s.loop.now
    assert ends[2] < ends[1]


def test_compare_with_a_saturation_only_result(tmp_path, capsys):
    from moeflow.cli import main
    from moeflow.experiment.serve import load_experiment

    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps({"auto_dtype": "float32", "memcpy_gbps": 10.0, "shm_flag_round_trip_us": 10.0,
                                   "gemm": {"bfloat16": {"gflops": 1.0}, "float32": {"gflops": 90.0}}}))
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(f"""
model: tiny
hardware: cpu-here
machine: {machine}
workload: {{kind: uniform, isl: 1024, isl_ratio: 0.5, num_requests: 12, seed: 3}}
rps: []
saturation_rps: 20
systems:
  dep2: {{mode: dep, dp: 2}}
  dwdp2: {{mode: dwdp, dp: 2}}
""")
    exp = load_experiment(str(cfg))
    cost = build_cost(exp)
    # "measured" = the simulator itself at seeds 3 and 4: zero error, inside the interval
    sims = [run_point(exp.systems["dwdp2"], cost, exp, 20, seed)[0]["prefill_tok_s"] for seed in (3, 4)]
    m = sum(sims) / 2
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"systems": {"dwdp2": {"points": [], "repeats": [{"seed": 3}, {"seed": 4}],
                                                          "saturation": {"rps": 20, "tok_s": {"mean": m, "ci95": [m * 0.9, m * 1.1]}}}}}))
    out = tmp_path / "o.json"
    assert main(["simulate", "--config", str(cfg), "--compare-with", str(measured), "--json", str(out)]) == 0
    c = json.loads(out.read_text())["comparison"]["dwdp2"]["saturation"]
    assert c["error"] == pytest.approx(0.0) and c["within_ci"] and c["simulated_values"] == pytest.approx(sims)
    assert "saturation at 20 rps" in capsys.readouterr().out
