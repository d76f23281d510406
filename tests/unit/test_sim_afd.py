"""The simulator's AFD at FastAFD's scale: the memory budget that sets B, the step timeline's
closed-form shortcut against the layer-by-layer loop, steady-state decode, FastAFD's per-GPU
speed-up and micro-batch table (configs/afd-gb200.yaml, a subset), `moeflow predict afd` on the
same inputs, and the simulator's speed for every system."""
from __future__ import annotations

import dataclasses
import functools
import time

import pytest

from moeflow.experiment.decode import load_decode_experiment
from moeflow.experiment.serve import parse_experiment
from moeflow.layout import make_layout
from moeflow.sim.decode import against_measured, closed_form, factors, simulate_decode
from moeflow.layout.memory import reserve as activation_reserve
from moeflow.sim.memory import GIB, model_sizes, plan_kv
from moeflow.sim.model_spec import model_preset
from moeflow.sim.run import build_cost, run_point

BENCH = load_decode_experiment("configs/afd-gb200.yaml")
COST = build_cost(BENCH)


@functools.lru_cache(maxsize=None)
def _decode(name: str, context: int = 8192, quiet: bool = False, **layout) -> dict:
    """A shorter window than the config's (4 steps after 1): steady decode repeats itself exactly.
    ``quiet``: compute jitter off (the closed forms and the mechanisms' shapes are checked without it)."""
    spec = BENCH.systems[name]
    if quiet:
        spec = dataclasses.replace(spec, sim=dataclasses.replace(spec.sim, compute_jitter_cv=0.0))
    if layout:
        spec = dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, **layout))
    return simulate_decode(spec, COST, context, 4, 1, COST.hw.hbm_bytes)


def test_the_memory_budget_sets_b_from_what_each_device_holds():
    m = model_preset("qwen3-235b-a22b-fp8")
    budget, reserve = 155.9 * GIB, activation_reserve(model_sizes(m), 8192, 1024)
    kv = m.kv_bytes_per_token_layer * m.num_layers
    assert kv == 94 * 2 * 4 * 128 * 2  # K and V of 4 KV heads x 128, bf16, 94 layers
    dep = plan_kv(m, make_layout("dep", dp=4), budget, 8192, 1024)
    afd = plan_kv(m, make_layout("afd", attn_workers=28, ffn_workers=4, topology="all"), budget, 8192, 1024)
    experts = m.num_moe_layers * m.num_experts * m.expert_bytes
    assert dep.kv_tokens == int((budget - m.attention_side_bytes - experts / 4 - reserve) // kv)
    assert afd.kv_tokens == int((budget - m.attention_side_bytes - reserve) // kv)  # no routed expert held
    assert {d.weights for d in afd.devices if d.name.startswith("ffn")} == {experts / 4}
    assert afd.kv_tokens / dep.kv_tokens == pytest.approx(1.57, abs=0.01)  # FastAFD §6: "approximately 1.5x"
    with pytest.raises(ValueError, match="too small for ffn0"):
        plan_kv(m, make_layout("afd", ffn_workers=1), budget, 8192, 1024)  # 227 GB of experts on one GPU
    with pytest.raises(ValueError, match="exceeds the device"):
        plan_kv(m, make_layout("dep", dp=4), 200e9, 8192, 1024, hbm_bytes=186e9)


def test_the_periodic_shortcut_matches_the_layer_by_layer_timeline(monkeypatch):
    """Oracle: with the shortcut disabled every layer is walked; the step ends at the same time."""
    import moeflow.sim.afd as afd_mod

    names = ("afd_12a4f", "afd_12a2f", "afd_12a4f_m3")  # attention-bound, FFN-bound, in between
    ends = {}
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(afd_mod, "_uniform_shift", lambda before, after: None)
            _decode.cache_clear()
        for name in names:
            ends[shortcut, name] = _decode(name, attn_workers=4)["tpot_s"]
    _decode.cache_clear()
    for name in names:
        assert ends[True, name] == pytest.approx(ends[False, name], rel=1e-9)


def test_fastafd_speedup_within_20pct_and_its_three_factors():
    """FastAFD §6: 1.35-1.45x decode tokens/s per GPU at 8K and 16K (Qwen3-235B on GB200 NVL72)."""
    base = {c: _decode("dep4", c, quiet=True) for c in (8192, 16384)}
    layout = BENCH.systems["afd_28a4f"].layout
    for c in (8192, 16384):
        afd = _decode("afd_28a4f", c, quiet=True)
        f = factors(afd, base[c], layout)
        assert f["speedup"] == pytest.approx(f["tok_s_ratio"], rel=1e-9)  # the decomposition is exact
        assert 0.8 * 1.35 <= f["speedup"] <= 1.2 * 1.45
        assert f["b_ratio"] == pytest.approx(1.58, abs=0.01) and f["node_factor"] == 28 / 32
        # with jitter, 28 instances wait for their slowest at every layer, dep4 for the slowest of 4
        noisy = factors(_decode("afd_28a4f", c), _decode("dep4", c), layout)
        assert noisy["speedup"] < f["speedup"]
        # predict afd's closed form on the same inputs (no jitter), and FastAFD's attention-only approximation
        p = closed_form(afd, base[c], layout, COST)
        assert p["b_afd"] == afd["batch_per_group"] and p["t_base_s"] == base[c]["tpot_s"]
        assert p["fastafd_t_afd_s"] == pytest.approx(afd["tpot_s"], rel=0.05)
        assert p["speedup"] == pytest.approx(f["speedup"], rel=0.05)  # the pipeline across layers, as simulated


def test_micro_batch_table_shape():
    """FastAFD §5: m = 2 is the best of 1-4 at 8 nodes (and its default); m = 1 has no overlap."""
    tpot = {m: _decode("afd_28a4f" if m == 2 else f"afd_28a4f_m{m}", quiet=True)["tpot_s"] for m in (1, 2, 3, 4)}
    assert min(tpot, key=tpot.get) == 2 and tpot[1] > tpot[2] * 1.2
    # FFN memory-bound: each micro-batch reads the experts again, so m = 4 is FFN-bound (busy ~100%)
    assert _decode("afd_28a4f_m4", quiet=True)["busy"]["ffn"] > 0.95


@pytest.mark.parametrize("name", ["afd_12a4f_m1", "afd_12a4f", "afd_12a4f_m4"])
def test_a_daemon_reads_its_experts_again_for_every_micro_batch(name):
    """Decode's FFN is bound by reading the weights: m micro-batches read them m times, so a
    daemon's seconds per step are the layers x the sum of its experts op over the micro-batches."""
    r = _decode(name, quiet=True)
    lay, m = BENCH.systems[name].layout, COST.model
    b, nub = r["batch_per_group"], lay.micro_batches
    tokens = [b // nub + (u < b % nub) for u in range(nub)]  # the scheduler's near-even split
    local = m.num_experts // lay.ffn_workers
    per_step = m.num_moe_layers * sum(COST.experts_s(round(lay.attn_workers * t * m.top_k / lay.ffn_workers), local)
                                      for t in tokens)
    assert r["busy"]["ffn"] * r["tpot_s"] == pytest.approx(per_step, rel=1e-9)
    one_read = COST.experts_s(round(lay.attn_workers * b * m.top_k / lay.ffn_workers), local)
    assert per_step > 0.9 * nub * m.num_moe_layers * one_read  # memory-bound: nearly m whole reads


def test_without_overlap_scheduling_each_step_pays_the_host_work():
    on, off = _decode("afd_28a4f"), _decode("afd_28a4f_no_overlap_scheduling")
    assert off["tpot_s"] - on["tpot_s"] == pytest.approx(COST.hw.host_step_s, rel=0.02)


@pytest.mark.parametrize("name,model,hw,system", [
    ("dwdp", "deepseek-r1", "gb200", {"mode": "dwdp", "dp": 4, "max_batch_tokens": 32768}),
    ("afd", "qwen3-235b-a22b-fp8", "gb200", {"mode": "afd", "attn_workers": 28, "ffn_workers": 4,
                                             "topology": "all", "router": "ffn", "max_batch_tokens": 32768}),
    ("dep", "deepseek-v3.2", "ascend-910c-die", {"mode": "dep", "dp": 8, "tp": 4, "max_batch_tokens": 32768}),
])
def test_five_simulated_minutes_at_20_rps_take_under_10_s(name, model, hw, system):
    """asap's run (the slowest, ~3-6 s here) is in docs/results/sim/speed_20rps.txt."""
    cfg = parse_experiment({"model": model, "hardware": hw, "rps": [20],
                            "workload": {"kind": "production", "duration_s": 300, "seed": 0},
                            "systems": {name: {**system, "engine": {"num_kv_blocks": 4096, "kv_block_size": 256,
                                                                    "max_num_seqs": 1024}}}})
    t0 = time.process_time()
    p, res = run_point(cfg.systems[name], build_cost(cfg), cfg, 20.0)
    took = time.process_time() - t0
    assert p["completed"] > 5500 and not res.stopped_early
    assert took < 10, f"{name}: {took:.1f} s of CPU for 5 simulated minutes"


def test_decode_needs_a_budget_and_a_step_system():
    spec = BENCH.systems["dep4"]
    with pytest.raises(ValueError, match="memory_budget_gib"):
        simulate_decode(dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, memory_budget_gib=None)),
                        COST, 8192, 4, 1)
    dwdp = dataclasses.replace(spec, layout=make_layout("dwdp", dp=4))
    with pytest.raises(ValueError, match="measures decode for"):
        simulate_decode(dwdp, COST, 8192, 4, 1)


def test_a_given_batch_is_simulated_as_bench_decode_runs_it_and_compared_with_a_measurement():
    spec = BENCH.systems["dep4"]
    given = simulate_decode(spec, COST, 8192, 4, 1, COST.hw.hbm_bytes, batch=8)
    assert given["batch_per_group"] == 2 and given["tok_s_per_device"] == pytest.approx(8 / given["tpot_s"] / 4)
    with pytest.raises(ValueError, match="split evenly"):
        simulate_decode(spec, COST, 8192, 4, 1, COST.hw.hbm_bytes, batch=6)
    # against a bench decode result: the error against its mean, inside its interval or not
    tok = given["tok_s_per_device"]
    measured = {"results": {"dep4": {"8192": {"resident_per_group": 2, "tpot_s": {"mean": given["tpot_s"]},
                                              "tok_s_per_process": {"mean": tok / 1.25, "ci95": [tok / 1.5, tok]}}}}}
    (row,) = against_measured({"dep4": {8192: given}, "afd_28a4f": {8192: given}}, measured)
    assert row["system"] == "dep4" and row["error"] == pytest.approx(0.25) and row["inside"]
    assert row["b_measured"] == 2 and row["b_plan"] == given["capacity_per_group"] > 2
