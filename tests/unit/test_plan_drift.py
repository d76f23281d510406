"""``moeflow plan`` on a drifting trace: the sizing arithmetic on numbers, the families' systems
validated by the experiment parser, and one whole answer on this machine's profile checked against
the simulator run the way ``moeflow simulate`` runs it."""
from __future__ import annotations

import json
import os

import pytest

from moeflow.config import ConfigError
from moeflow.plan.candidates import Candidate
from moeflow.plan.drift import pick, simulate
from moeflow.plan.drift_candidates import Policy, aggregated, pd
from moeflow.plan.drift_sizes import (Moment, estimate, following, length_range, max_rise, moments, needs,
                                      quantile_sizes, quantile_units, served, unit_rate)
from moeflow.plan.question import PlanQuestion, parse_curve

PROFILE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "profile_tiny_fp32.json")


def test_the_trace_is_read_at_the_middle_of_equal_spans():
    ms = moments(10.0, ((0, 1), (100, 3)), ((0, 1), (200, 4)), 200.0, n=4)
    assert [m.t_s for m in ms] == [25, 75, 125, 175]
    assert [m.rps for m in ms] == pytest.approx([15, 25, 30, 30])  # flat beyond the last knot
    assert [m.length for m in ms] == pytest.approx([1.375, 2.125, 2.875, 3.625])
    assert length_range(((0, 1), (200, 4)), 100.0) == (1.0, 2.5)  # a knot past the end: the curve at the end
    assert length_range(((0, 2), (50, 0.5), (100, 1)), 300.0) == (0.5, 2.0)
    assert length_range((), 10.0) == (1.0, 1.0)


def test_a_units_rate_is_harmonic_between_its_two_estimates():
    """1 / rate affine in the length factor: exact at the ends, 1/(0.1 + 0.4/2) halfway."""
    assert unit_rate((1, 10), (3, 2), 1) == pytest.approx(10)
    assert unit_rate((1, 10), (3, 2), 3) == pytest.approx(2)
    assert unit_rate((1, 10), (3, 2), 2) == pytest.approx(1 / 0.3)
    assert unit_rate((1, 10), (1, 10), 5) == 10
    assert needs([Moment(0, 20, 1), Moment(1, 4, 3)], (1, 10), (3, 2)) == pytest.approx([2, 2])


def test_fixed_sizes_are_the_needs_quantiles_rounded_up_within_bounds():
    need = [0.5, 1.2, 2.0, 3.7]
    assert quantile_units(need, 1, 10) == [4, 4, 2, 2]  # nearest rank at 1, 0.9, 0.75, 0.5
    assert quantile_sizes(need, 1, 10) == [2, 4]
    assert quantile_sizes(need, 3, 10) == [3, 4]
    assert quantile_sizes(need, 1, 3) == [2, 3]
    assert quantile_sizes([2.0, 2.0], 1, 9) == [2]  # an exact need is not rounded up past itself
    assert following([0.2, 2.0, 2.01, 9.0], 1, 5) == [1, 2, 3, 5]
    assert max_rise([1, 1, 2.5, 4, 4, 1], span=2) == 3  # 1 -> 4 within two moments
    assert max_rise([3, 2, 1], span=1) == 1  # falling: at least one


def test_a_sides_backlog_carries_over_and_its_slack_decides():
    ms = [Moment(k, r, 1) for k, r in enumerate([2, 6, 2, 2])]
    assert served(ms, [4] * 4, 0.0, 1.0) == [True, False, True, True]  # backlog 0, 2, 0, 0
    assert served(ms, [4] * 4, 0.5, 1.0) == [True, True, True, True]  # 2 waiting: half a second of capacity
    assert served(ms, [3] * 4, 0.0, 1.0) == [True, False, False, False]  # 3 left, then 2, then 1
    assert following([1, 5, 2, 2], 1, 9, lag=1) == [1, 1, 5, 2]


def test_the_estimate_counts_the_arrivals_served_over_the_devices_held():
    ms = [Moment(0, 1, 1), Moment(1, 3, 1), Moment(2, 1, 1)]
    need = [1, 3, 1]
    big = estimate(ms, [3] * 3, [3 >= x for x in need])
    small = estimate(ms, [1] * 3, [1 >= x for x in need])
    elastic = estimate(ms, following(need, 1, 3), [True] * 3)
    assert (big.good_per_device_s, big.within, big.mean_devices) == pytest.approx((5 / 9, 1, 3))
    assert (small.good_per_device_s, small.within) == pytest.approx((2 / 3, 2 / 5))
    assert elastic.good_per_device_s == pytest.approx(1.0) and elastic.mean_devices == pytest.approx(5 / 3)


RAMP = [Moment(5.0 + 10 * k, r, 1.0) for k, r in enumerate([2, 2, 6, 10, 10, 4, 2, 2])]
POLICY = Policy(0.05, 3.0, moment_s=10.0)


def _parsed(name: str, system: dict):
    from moeflow.experiment.serve import parse_experiment

    return parse_experiment({"model": "deepseek-r1", "hardware": "gb200", "slo_ttft_s": 3.0, "slo_tpot_s": 0.05,
                             "rps": [1.0], "workload": {"kind": "fixed", "fixed_len": 64, "output_len": 4,
                                                        "num_requests": 4}, "systems": {name: system}})


def test_a_dep_family_sizes_from_its_memory_floor_and_its_elastic_one_is_a_valid_system():
    """dep8 estimated at 8 rps (1 rps per rank) at both lengths; fewer than 3 ranks do not fit: the
    fixed sizes are the ramp's quantiles (10 at the peak, 6 at 0.75, 2 at 0.5: raised to the floor 3), the elastic
    one starts at the first moment's need raised to the floor and may reach the budget of 12."""
    c = Candidate("dep8", {"mode": "dep", "dp": 8}, 8, "aggregated")

    def fits(x):
        return x if x.system["dp"] >= 3 else Candidate(x.name, x.system, x.devices, x.kind, False, "too small")
    got = {d.name: d for d in aggregated(c, (1.0, 8.0), (1.0, 8.0), RAMP, 12, fits, POLICY)}
    assert set(got) == {"dep10", "dep6", "dep3", "elastic:dep"}, got
    assert got["dep10"].estimate.within == 1.0 and got["dep3"].estimate.within < 1.0
    e = got["elastic:dep"]
    assert e.elastic and e.devices == 12
    assert e.system["dp"] == 3 and e.system["max_dp"] == 12
    assert e.system["autoscale"] == {"tpot_slo_s": 0.05, "ttft_slo_s": 3.0, "min_ranks": 3, "max_ranks": 12,
                                     "max_step": 4}  # 6 -> 10 within one 10-s interval
    # one moment behind the ramp (a 6-s window over 10-s moments): short while it rises, fewer ranks held
    assert e.estimate.within < 1.0 and e.estimate.mean_devices < 10
    _parsed(e.name, e.system)  # the experiment's own checks (check_autoscale) accept it


def test_a_pd_family_sizes_each_side_within_the_budget_and_its_policy_is_valid():
    c = Candidate("pd_dwdp4_dep8", {"mode": "pd", "prefill": {"mode": "dwdp", "dp": 4},
                                    "decode": {"mode": "dep", "dp": 8}}, 12, "pd")
    got = pd(c, ((1.0, 3.0), (1.0, 3.0)), ((1.0, 6.0), (1.0, 6.0)), RAMP, 32, POLICY)
    fixed = [d for d in got if not d.elastic]
    assert all(d.devices <= 32 for d in got)
    sizes = {(d.system["prefill_instances"], d.system["decode_instances"]) for d in fixed}
    # the peak (10 rps) needs 4 prefill (16 devices) and 2 decode (16): 32, the budget; 6 rps at 0.75: 2 and 1
    assert sizes == {(x, y) for x in (1, 2, 4) for y in (1, 2)}  # each side's sizes, every pair in the budget
    (e,) = [d for d in got if d.elastic]
    a = e.system["autoscale"]
    assert (e.system["prefill_instances"], e.system["decode_instances"]) == (1, 1)
    assert (a["min_prefill"], a["min_decode"], a["max_prefill"], a["max_decode"], a["max_processes"]) == (1, 1, 6, 3, 32)
    _parsed(e.name, e.system)


def test_the_whole_simulations_take_the_best_of_both_kinds():
    from moeflow.plan.drift_candidates import DriftCandidate
    from moeflow.plan.drift_sizes import Estimate

    cs = [DriftCandidate(f"{'e' if el else 'f'}{k}", "x", {}, el, 1, Estimate(v, 1, 1))
          for k, (el, v) in enumerate([(True, 9), (True, 8), (True, 7), (False, 3), (False, 2), (False, 1)])]
    assert [c.name for c in pick(cs, top=1, confirm=3, include=())] == ["e0", "e1", "f3"]
    assert [c.name for c in pick(cs, top=1, confirm=2, include=("f5",))] == ["e0", "f3", "f5"]


def test_the_drifting_question_refuses_what_it_cannot_answer():
    kw = dict(model="tiny", devices=2, isl=64, osl=4, ttft_s=2.0, profile=PROFILE)
    with pytest.raises(ConfigError, match="give --request-rate"):
        PlanQuestion(**kw, rate_curve=((0, 1), (10, 2)))
    with pytest.raises(ConfigError, match="--tpot-ms"):
        PlanQuestion(**kw, rps=1.0)
    with pytest.raises(ConfigError, match="knot times must increase"):
        PlanQuestion(**kw, rps=1.0, tpot_ms=100, length_curve=((10, 1), (5, 2)))
    with pytest.raises(ConfigError, match="T_S:FACTOR"):
        parse_curve("0:1,100", "--rate-curve")
    assert parse_curve("0:1, 100:3", "--rate-curve") == ((0.0, 1.0), (100.0, 3.0))


def test_a_whole_answer_on_this_machines_profile_is_the_simulators_own_run(tmp_path, capsys):
    """The drifting plan on 3 processes of this machine's profile: it ranks simulated candidates
    first and names a best; that best's number is what the simulator gives the same system on the
    same trace through ``sim.run`` (as ``moeflow simulate`` runs it)."""
    from moeflow.cli import main
    from moeflow.experiment.serve import parse_experiment
    from moeflow.sim.run import build_cost, run_point

    out = tmp_path / "drift.json"
    assert main(["plan", "--model", "tiny", "--profile", PROFILE, "--devices", "3", "--isl", "128", "--osl", "8",
                 "--ttft-s", "2", "--tpot-ms", "300", "--kinds", "pd", "--request-rate", "0.5", "--rate-curve", "0:1,20:3,40:1",
                 "--length-curve", "0:1,40:2", "--duration-s", "60", "--jobs", "1", "--confirm", "3", "--top", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    d = json.loads(out.read_text())
    rows = d["candidates"]
    simulated = [r for r in rows if r["simulated"]]
    assert rows[:len(simulated)] == simulated
    assert any(r["elastic"] for r in simulated) and any(not r["elastic"] for r in simulated)
    # the best elastic one weighed against every fixed size of its own layout
    top = next(r for r in simulated if r["elastic"])
    assert all(r["simulated"] for r in rows if r["family"] == top["family"])
    assert len(simulated) < len(rows)  # the rest stay estimates
    best = d["best"]
    assert best["name"] == simulated[0]["name"] and f"best: {best['name']}" in printed
    import shlex

    from moeflow.cli import build_parser

    args = build_parser().parse_args(shlex.split(best["command"])[1:])  # a command moeflow serve takes
    assert args.mode == "pd" and (args.autoscale == "POLICY.yaml") == best["elastic"]
    base = {"model": "tiny", "hardware": "cpu-here", "cost": "profiled", "profile": PROFILE, "slo_ttft_s": 2.0,
            "slo_tpot_s": 0.3, "slo_metric": "p90", "rps": [0.5],
            "workload": {"kind": "fixed", "fixed_len": 128, "output_len": 8, "seed": 0, "duration_s": 60,
                         "rate_curve": [[0, 1], [20, 3], [40, 1]], "length_curve": [[0, 1], [40, 2]]}}
    cfg = parse_experiment({**base, "systems": {"x": best["system"]}})
    p, _ = run_point(cfg.systems["x"], build_cost(cfg), cfg, 0.5, 0)
    assert best["good_per_process_s"] == pytest.approx(p["goodput_per_process_s"])
    assert simulate(("x", best["system"], base, 1))["good_per_process_s"] == pytest.approx(p["goodput_per_process_s"])


@pytest.mark.parametrize("start", [{"mode": "dep", "dp": 2}, {"mode": "afd", "attn_workers": 2, "ffn_workers": 2,
                                                              "micro_batches": 2}])
def test_an_aggregated_familys_elastic_deployment_runs_in_the_simulator(start):
    """The elastic systems the plan writes for dep and afd run whole under their controllers (tiny
    on gb200, a short ramp), with good requests and process-seconds to rank them by."""
    c = Candidate("x", start, 4, "aggregated")
    ms = moments(4.0, ((0, 1), (10, 4), (20, 1)), (), 30.0, n=6)
    (e,) = [d for d in aggregated(c, (1.0, 4.0), (1.0, 4.0), ms, 8, lambda x: x, Policy(0.2, 2.0, moment_s=5.0))
            if d.elastic]
    base = {"model": "tiny", "hardware": "gb200", "slo_ttft_s": 2.0, "slo_tpot_s": 0.2, "rps": [4.0],
            "workload": {"kind": "fixed", "fixed_len": 64, "output_len": 8, "seed": 0, "duration_s": 30,
                         "rate_curve": [[0, 1], [10, 4], [20, 1]]}}
    r = simulate((e.name, e.system, base, 1))
    assert r["simulated"], r
    (run,) = r["runs"]
    assert run["within"] > 0 and run["process_s"] > 0 and r["good_per_process_s"] > 0


def test_an_elastic_afd_never_shrinks_below_the_daemons_that_hold_its_experts():
    c = Candidate("afd_2a2f_m2", {"mode": "afd", "attn_workers": 2, "ffn_workers": 2, "micro_batches": 2}, 4,
                  "aggregated")

    def fits(x):  # the experts need three daemons
        return x if x.system["ffn_workers"] >= 3 else Candidate(x.name, x.system, x.devices, x.kind, False, "experts")
    ms = moments(2.0, (), (), 30.0, n=6)
    (e,) = [d for d in aggregated(c, (1.0, 8.0), (1.0, 8.0), ms, 12, fits, POLICY) if d.elastic]
    assert (e.system["attn_workers"], e.system["ffn_workers"]) == (3, 3)  # the family's floor: 3 units of 1:1
    assert e.system["autoscale"]["min_ffn"] == 3 and e.system["autoscale"]["min_attention"] == 1
    (free,) = [d for d in aggregated(c, (1.0, 8.0), (1.0, 8.0), ms, 12, lambda x: x, POLICY) if d.elastic]
    assert free.system["autoscale"]["min_ffn"] == 1
