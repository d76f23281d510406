"""``moeflow plan``: the candidates, the memory check, the search and the commands it prints."""
from __future__ import annotations

import dataclasses
import os

import pytest

from moeflow.engine.args import engine_kwargs
from moeflow.layout import make_layout
from moeflow.plan.candidates import Candidate, check_memory, enumerate_candidates, side_devices
from moeflow.plan.command import serve_command
from moeflow.plan.search import Slo, evaluate, search, shared_cores
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset


def test_every_candidate_uses_exactly_the_devices_once():
    for n in (1, 2, 4, 8):
        cands = enumerate_candidates(n)
        assert len({c.name for c in cands}) == len(cands) > 0
        assert all(make_layout(c.system["mode"], **{k: v for k, v in c.system.items() if k != "mode"}).num_processes == n
                   for c in cands if c.kind == "aggregated")
        # a pd pair: one instance of each side fits; rate matching picks how many of each
        assert all(side_devices(c.system["prefill"]) + side_devices(c.system["decode"]) == c.devices <= n
                   for c in cands if c.kind == "pd")
    kinds = {c.system["mode"] for c in enumerate_candidates(4)}
    assert kinds == {"dep", "dwdp", "asap", "afd", "pd"}
    pd = [c for c in enumerate_candidates(4) if c.kind == "pd"]
    assert {c.system["prefill"]["mode"] for c in pd} == {"dep", "dwdp", "asap"}
    assert {c.system["decode"]["mode"] for c in pd} == {"dep", "afd"}


def test_a_layout_that_does_not_fit_memory_is_refused_with_its_numbers_and_never_ranked():
    m, hw = model_preset("qwen3-235b-a22b-fp8"), hardware_preset("h200")
    cands = [check_memory(c, m, hw.hbm_bytes, 0.9, 4096, 8192, 256, 16) for c in enumerate_candidates(2)]
    bad = [c for c in cands if not c.feasible]
    assert bad and all("GiB" in c.reason for c in bad)  # 235B of fp8 weights do not fit two 141 GB devices
    assert all(c.system.get("engine", {}).get("num_kv_blocks", 1) > 0 for c in cands if c.feasible)
    ranked = search(bad[:2], {}, Slo(1.0, None), 1.0, jobs=1, progress=None)
    assert all(not r["feasible"] and "goodput_per_device" not in r for r in ranked)


def test_the_kv_blocks_come_from_the_memory_plan():
    m, hw = model_preset("qwen3-235b-a22b-fp8"), hardware_preset("h200")
    c = next(c for c in enumerate_candidates(8, ("aggregated",)) if c.name == "dep8")
    fit = check_memory(c, m, hw.hbm_bytes, 0.9, 4096, 8192, 256, 16)
    assert fit.feasible and fit.system["engine"]["num_kv_blocks"] == fit.kv_tokens["all"] // 16
    less = check_memory(c, m, hw.hbm_bytes, 0.6, 4096, 8192, 256, 16)
    assert less.kv_tokens["all"] < fit.kv_tokens["all"]


def test_a_deployment_the_engine_cannot_run_gets_no_command_but_the_reason():
    c = next(c for c in enumerate_candidates(4) if c.name == "dep2_tp2")
    assert serve_command("tiny", c.system) is None


@pytest.mark.parametrize("name", ["dep4", "asap_d1t2e2", "afd_1a3f_m2", "pd_asap_d1e1_afd_1a1f", "pd_dwdp2_dep2"])
def test_the_printed_command_starts_the_deployment_it_names(name):
    from moeflow.cli import build_parser

    c = next(c for c in enumerate_candidates(4) if c.name == name)
    c = check_memory(c, model_preset("tiny"), hardware_preset("h200").hbm_bytes, 0.9, 1024, 8192, 256, 16)
    if c.kind == "pd":  # the instance counts rate matching chose
        c = dataclasses.replace(c, system={**c.system, "prefill_instances": 1, "decode_instances": 1})
    cmd = serve_command("tiny", c.system)
    args = build_parser().parse_args(cmd.split()[1:])
    kw = engine_kwargs(args)
    mode = kw.pop("mode")
    layout_keys = {k: v for k, v in kw.items() if k in {k2 for k2 in c.system if k2 not in ("mode", "engine")}}
    assert make_layout(mode, **layout_keys) == make_layout(c.system["mode"], **{k: v for k, v in c.system.items()
                                                                                if k not in ("mode", "engine")})
    assert kw["num_kv_blocks"] == c.system["engine"]["num_kv_blocks"]


# a copy of docs/results/sim/profile_cpu_here.json: a result file may be replaced by a new measurement
PROFILE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "profile_cpu_here.json")
BASE = {"model": "tiny", "hardware": "cpu-here", "cost": "profiled", "profile": PROFILE,
        "slo_ttft_s": 2.0, "workload": {"kind": "fixed", "fixed_len": 256, "output_len": 8, "num_requests": 40, "seed": 0}}


def test_the_search_brackets_the_slo_rate_and_ranks_by_goodput_per_device():
    """On this machine's profile, tiny saturates: every candidate simulated whole has its SLO rate
    bracketed (a rate that meets both bounds below one that misses), and the ranking follows
    goodput per device; what is left an estimate never ranks above the best simulated one."""
    cands = [c for c in enumerate_candidates(2) if c.name in ("dep2", "pd_dep1_dep1")]
    slo = Slo(2.0, 0.5, "p90")
    ranked = search(cands, BASE, slo, None, jobs=1, progress=None, memory_gib=2.0, confirm=2)
    whole = [r for r in ranked if not r["estimated"]]
    assert whole and ranked[0] is whole[0]
    for r in whole:
        assert r["feasible"] and r["slo_rps"] is not None and r["upper_rps"] > r["slo_rps"], r
        assert r["at_slo"]["ttft_p90_s"] <= 2.0 and r["at_slo"]["tpot_p90_s"] <= 0.5
        assert r["goodput_per_device"] == pytest.approx(r["slo_rps"] / r["used"])  # per device, or per core of a CPU host's
    assert ranked[0]["goodput_per_device"] >= max(r["goodput_per_device"] for r in ranked[1:])
    dep2 = next(r for r in ranked if r["name"] == "dep2")
    if not dep2["estimated"]:  # a whole search starts from its estimate; from there it is deterministic
        assert evaluate(cands[0], BASE, slo, dep2["start_rps"])["slo_rps"] == dep2["slo_rps"]


def test_rate_matching_picks_the_split_a_brute_force_of_whole_simulations_picks():
    """One pd pair on 3 devices of this machine's profile: every (X, Y) split simulated whole, and
    the best of them is the split rate matching chose from the two sides alone."""
    from moeflow.plan import estimate

    slo = Slo(2.0, 0.5, "p90")
    (pair,) = [c for c in enumerate_candidates(3, ("pd",)) if c.name == "pd_dep1_dep1"]
    sides = {s: (estimate.prefill_side(evaluate(Candidate("p", lay, 1, "aggregated"), estimate.prefill_only(BASE),
                                                Slo(2.0, None, "p90"), None), 1) if s == "prefill" else
                 estimate.decode_capacity(lay, 1, BASE, slo, 2.0, 0.0)) for s, lay in estimate.sides_of(pair)}
    chosen = estimate.compose(pair, sides["prefill"], sides["decode"], 3, shared_cores(BASE))["system"]
    whole = {}
    for x, y in ((1, 1), (2, 1), (1, 2)):
        c = Candidate(pair.name, {**pair.system, "prefill_instances": x, "decode_instances": y}, x + y, "pd")
        whole[(x, y)] = evaluate(c, BASE, slo, None)["goodput_per_device"]
    assert max(whole, key=whole.get) == (chosen["prefill_instances"], chosen["decode_instances"]), (whole, chosen)


@pytest.mark.parametrize("target", [["--hardware", "gb200"], ["--profile", PROFILE],
                                    ["--profile", os.path.join(os.path.dirname(PROFILE), "profile_tiny_fp32.json")]])
def test_rates_are_said_to_be_per_core_only_for_a_cpu_host(target, capsys):
    """A device preset's processes each have a device; a profiled host's share its cores where
    the profile knows them (profile_cpu_here.json predates provenance: it does not)."""
    from moeflow.cli import main

    model = "deepseek-r1" if target[0] == "--hardware" else "tiny"
    assert main(["plan", "--model", model, *target, "--devices", "1", "--isl", "256", "--osl", "8", "--ttft-s", "2",
                 "--confirm", "0", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and ("per core used" in out) == target[1].endswith("fp32.json"), out
