"""The evidence layer: intervals over repeats, SLO metrics, capacity, provenance on every result
file, and the simulator compared against a measured ``bench compare`` result."""
from __future__ import annotations

import json
import math
import os
import re

import pytest

from moeflow.measure.capacity import capacity_tok_s, request_compute_s, steady_window, time_split
from moeflow.measure.slo import ALL_METRICS, MEAN, SloMetric, slo_rps_from_points
from moeflow.measure.stats import mean_ci, paired_ratio_ci, t975, verdict
from moeflow.measure.workload import WorkloadConfig
from moeflow.messages import Span


def test_t_intervals_match_the_tables():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(30) == 2.042 and t975(1000) == pytest.approx(1.96, abs=1e-3)
    ci = mean_ci([1.0, 2.0, 3.0])  # mean 2, sd 1, n 3: half-width 4.303 / sqrt(3)
    assert ci.mean == 2.0 and ci.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([5.0]).n == 1 and mean_ci([None, math.inf]) is None
    r = paired_ratio_ci([2.0, 4.0, None], [1.0, 2.0, 3.0])  # pairs with a missing value are dropped
    assert r.n == 2 and r.mean == 2.0
    a, b = mean_ci([1.0, 1.1, 0.9]), mean_ci([2.0, 2.1, 1.9])
    assert verdict(a, b, paired_ratio_ci([2.0, 2.1, 1.9], [1.0, 1.1, 0.9])) == "distinguishable"
    assert verdict(a, mean_ci([1.05, 0.95, 1.0]), None) == "not distinguishable"
    assert verdict(mean_ci([1.0]), mean_ci([2.0]), None) == "single run"
    # overlapping intervals of each system, a paired ratio that excludes 1: decided on the pairing
    spread, shifted = [2.0, 3.0, 4.0], [2.6, 3.8, 5.2]
    assert mean_ci(spread).overlaps(mean_ci(shifted))
    assert verdict(mean_ci(spread), mean_ci(shifted), paired_ratio_ci(shifted, spread)) == "distinguishable"


def _point(rps, ttfts, unfinished=0, **kw):
    return {"rps": rps, "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None, "ttfts_s": sorted(ttfts),
            "num_requests": len(ttfts) + unfinished, **kw}


def test_slo_metrics_count_every_request_and_agree_on_percentile_and_attainment():
    p = _point(1.0, [1.0] * 8 + [10.0, 20.0])  # mean 3.8; 80% within 2 s
    assert MEAN.score(p) == pytest.approx(3.8)
    assert SloMetric.parse("p50").score(p) == 1.0 and SloMetric.parse("p90").score(p) == 10.0
    assert SloMetric.parse("attainment:0.8").score(p) == 1.0  # 8 of 10 within it
    assert SloMetric.parse("attainment:0.9").score(p) == SloMetric.parse("p90").score(p)
    # a request that never got a first token counts as missing: 8 of 12 is below 90%
    assert SloMetric.parse("p90").score(_point(1.0, [1.0] * 10, unfinished=2)) == math.inf
    with pytest.raises(ValueError, match="SLO metric must be one of"):
        SloMetric.parse("p95x")
    # an early stop: certainly failed once too many requests waited past the SLO
    p90 = SloMetric.parse("p90")
    assert not p90.certainly_fails([1.0] * 9, [], 10, now_s=100.0, slo_s=2.0)
    assert p90.certainly_fails([1.0] * 8, [0.0, 0.0], 10, now_s=5.0, slo_s=2.0)  # 2 of 10 already beyond 2 s
    assert not MEAN.certainly_fails([1.0], [4.0], 2, now_s=5.0, slo_s=2.0)  # (1 + 1) / 2 = 1


def test_slo_throughput_under_every_metric_from_the_same_points():
    pts = [_point(1.0, [0.5] * 10), _point(2.0, [0.5] * 9 + [30.0]), _point(4.0, [5.0] * 10)]
    got = {m.name: slo_rps_from_points(pts, m, slo_s=2.0).rps for m in ALL_METRICS}
    assert got == {"mean": 1.0, "p50": 2.0, "p90": 2.0, "p99": 1.0, "attainment:0.95": 1.0}
    stopped = _point(4.0, [0.5], unfinished=9, stopped_early=True, stopped_by="p90")  # decides p90 only
    pts2 = pts[:2] + [stopped]
    assert slo_rps_from_points(pts2, SloMetric.parse("p90"), 2.0).upper_rps == 4.0
    assert slo_rps_from_points(pts2, MEAN, 2.0).upper_rps == 2.0  # the mean ignores it
    # every measured rate meets it: the highest is a lower bound, not the SLO throughput
    unbracketed = slo_rps_from_points(pts[:1], MEAN, 2.0)
    assert (unbracketed.rps, unbracketed.upper_rps, getattr(unbracketed, "at_least_rps", None)) == (None, None, 1.0)


def test_the_simulator_comparison_reads_an_unbracketed_measured_slo_as_a_bound():
    from moeflow.measure.slo import slo_over_repeats
    from moeflow.sim.compare import compare, format_comparison

    point = {"rps": 0.8, "ttft_mean_s": 2.0}
    # a bench compare result written before bounds were kept apart: 0.8 rps, the sweep's highest
    # rate, met the SLO in every repeat and its median was stored as the SLO throughput
    measured = {"slo_metric": "mean", "slo_rps": 0.8, "points": [point],
                "repeats": [{"slo": {"mean": {"rps": 0.8, "upper_rps": None, "num_probes": 0}}}] * 3}
    simulated = {"slo_metric": "mean", "slo_rps": None, "points": [point],
                 "slo_rps_by_metric": {"mean": slo_over_repeats([{"rps": 0.5, "upper_rps": 0.8}])}}
    c = compare(simulated, measured)
    assert (c["measured_slo_rps"], c["measured_slo_rps_at_least"], c["simulated_slo_rps"]) == (None, 0.8, 0.5)
    assert c["slo_error"] is None and "measured >= 0.8 rps, simulated 0.5 rps (a bound" in format_comparison("x", c)


PROFILE = {"num_layers": 2, "num_experts": 4, "top_k": 2, "hidden_size": 8, "dtype": "float32",
           "attention": {"fit": {"c0": 0.0, "per_token": 1e-4, "per_pair": 1e-7, "per_seq": 0.0}},
           "head": {"fit": {"c0": 0.0, "per_token": 0.0, "per_sampled": 1e-3}},
           "experts": {"4": [[16, 0.01], [1024, 0.05], [4096, 0.1]]}}


def test_capacity_is_cores_over_colocated_compute_at_the_best_expert_rate():
    best = 0.1 / 4096  # s per routed pair at the largest batch
    n = 100
    assert request_compute_s(PROFILE, n) == pytest.approx(2 * (1e-4 * n + 1e-7 * n * (n + 1) / 2 + n * 2 * best) + 1e-3)
    cap = capacity_tok_s(PROFILE, WorkloadConfig(kind="fixed", rate_rps=1.0, fixed_len=n, num_requests=3, seed=0), cores=2)
    assert cap["tok_s"] == pytest.approx(2 * n / request_compute_s(PROFILE, n))
    spans = [Span("attention", "attention0/main", 0.0, 4.0), Span("wait-combine", "attention0/main", 4.0, 6.0),
             Span("dispatch", "attention0/main", 6.0, 7.0), Span("experts", "moe0/main", 1.0, 3.0),
             Span("recv", "moe0/recv", 0.0, 10.0)]
    split = time_split(spans, 0.0, 10.0)
    assert split["attention0"] == pytest.approx({"compute": 0.4, "transport": 0.1, "wait": 0.2, "idle": 0.3})
    assert split["moe0"]["compute"] == pytest.approx(0.2) and split["moe0"]["idle"] == pytest.approx(0.8)


def test_the_steady_window_ignores_spans_from_before_the_run():
    # a copy thread's pulls that ended after the previous collection arrive with this run's spans
    stale = Span("pull", "dwdp0/copy", 100.0, 101.0)
    run = [Span("attention", "dwdp0/main", 500.0, 540.0), Span("experts", "dwdp1/main", 502.0, 550.0)]
    assert steady_window(run + [stale], 499.0, 551.0) == pytest.approx((505.0, 545.0))
    assert steady_window([stale], 499.0, 551.0) is None
    assert time_split(run + [stale], *steady_window(run + [stale], 499.0, 551.0))["dwdp0"]["compute"] == pytest.approx(35 / 40)


# writers that legitimately write other JSON: the SSE stream, Chrome traces, the checkpoint's
# config.json, the per-machine probe cache
_NOT_RESULTS = {"moeflow/server/serving.py", "moeflow/engine/trace.py", "moeflow/model/tiny.py",
                "moeflow/hardware/probe.py", "moeflow/measure/provenance.py", "moeflow/bench/env.py",
                "moeflow/model/extension.py"}  # a build's inputs beside it, not a result


def test_every_result_writer_goes_through_write_json():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(root, "moeflow")):
        for f in files:
            path = os.path.relpath(os.path.join(dirpath, f), root)
            if f.endswith(".py") and path not in _NOT_RESULTS:
                with open(os.path.join(dirpath, f)) as fh:
                    if re.search(r"json\.dump\(", fh.read()):
                        offenders.append(path)
    assert not offenders, f"these write JSON without provenance: {offenders}"


def test_results_carry_provenance(tmp_path):
    from moeflow.cli import main

    out = tmp_path / "sim.json"
    cfg = tmp_path / "e.yaml"
    cfg.write_text("model: tiny\nhardware: h200\nworkload: {kind: fixed, fixed_len: 64, duration_s: 2, seed: 0}\n"
                   "rps: [1]\nsystems:\n  a: {mode: dep, dp: 2}\n")
    assert main(["simulate", "--config", str(cfg), "--json", str(out)]) == 0
    prov = json.loads(out.read_text())["provenance"]
    assert {"commit", "dirty", "command", "date", "torch", "python", "cpu_model", "cores", "hostname_hash"} <= set(prov)
    assert prov["command"].endswith(f"simulate --config {cfg} --json {out}") and len(prov["commit"]) == 40
    # a summary by default: --raw adds every request's TTFT and changes nothing else
    from moeflow.measure.metrics import without_raw

    raw = tmp_path / "raw.json"
    assert main(["simulate", "--config", str(cfg), "--json", str(raw), "--raw"]) == 0
    summary, full = (json.loads(p.read_text()) for p in (out, raw))
    assert "ttfts_s" not in out.read_text() and len(full["points"][0]["ttfts_s"]) == full["points"][0]["completed"]
    drop = {"provenance", "sim_speed"}  # when and how fast it ran
    assert {k: v for k, v in without_raw(full).items() if k not in drop} == {k: v for k, v in summary.items()
                                                                             if k not in drop}


def test_a_value_with_no_json_form_leaves_the_previous_result_whole(tmp_path):
    import numpy as np

    from moeflow.measure.provenance import write_json

    path = tmp_path / "r.json"
    # numpy scalars (a comparison of numpy floats is a numpy bool) are written as their values
    write_json(str(path), {"provenance": {"command": "t"}, "inside": np.float64(1.0) < np.float64(2.0),
                           "x": np.float32(0.5)})
    assert json.loads(path.read_text())["inside"] is True and json.loads(path.read_text())["x"] == 0.5
    with pytest.raises(TypeError, match="has no JSON form"):
        write_json(str(path), {"provenance": {"command": "t"}, "bad": object()})
    assert json.loads(path.read_text())["inside"] is True and os.listdir(tmp_path) == ["r.json"]


RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results")


def _committed_results():
    """(path under docs/results, parsed JSON) of every committed result file."""
    for dirpath, _, files in os.walk(RESULTS):
        for f in files:
            if f.endswith(".json"):
                with open(os.path.join(dirpath, f)) as fh:
                    yield os.path.relpath(os.path.join(dirpath, f), RESULTS), json.load(fh)


def test_every_committed_result_file_has_provenance():
    """Results written before provenance existed carry a backfilled block (``recorded: false``)."""
    missing = [path for path, d in _committed_results()
               if not (isinstance(d, dict) and isinstance(d.get("provenance"), dict) and d["provenance"].get("commit"))]
    assert not missing, f"result files without provenance: {missing}"


def test_committed_results_are_summaries_within_10_mb():
    """Per-request arrays are regenerated, not committed: a simulated result is written without
    them (``simulate --raw`` keeps them), and all of docs/results stays under 10 MB."""
    from moeflow.measure.metrics import without_raw

    def simulated(d) -> bool:
        return isinstance(d, dict) and str((d.get("provenance") or {}).get("command")).startswith("moeflow simulate")

    raw = [path for path, d in _committed_results() if simulated(d) and without_raw(d) != d]
    assert not raw, f"simulated results with per-request arrays: {raw}"
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(RESULTS) for f in fs)
    assert total <= 10 * 2**20, f"docs/results holds {total / 2**20:.1f} MiB"
