"""Serving metrics on synthetic records: TTFT stats, Fig. 15 buckets, the early-stop bound, and
the SLO bisection on a known monotone TTFT(rate)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moeflow.measure.metrics import (RequestRecord, bucket_edges, buckets, format_point, mean_ttft_lower_bound,
                                     summarize)
from moeflow.measure.plot import label
from moeflow.measure.slo import SloSearch, find_slo_rps


def _rec(prompt_len: int, arrival: float, queue: float, compute: float | None, other: float) -> RequestRecord:
    first_token = arrival + queue + (compute or 0.0) + other
    return RequestRecord(prompt_len, arrival, arrival + queue, first_token, compute, first_token + 0.01)


def test_record_decomposes_ttft():
    r = _rec(100, 10.0, 0.5, 0.3, 0.2)
    assert r.ttft_s == pytest.approx(1.0)
    assert (r.queue_s, r.compute_s, r.other_s) == pytest.approx((0.5, 0.3, 0.2))
    assert _rec(100, 10.0, 0.5, None, 0.2).other_s is None
    with pytest.raises(ValueError, match="out of order"):
        RequestRecord(1, 5.0, 5.0, 4.0, 0.1, 6.0)


def test_summary_stats_and_throughput():
    recs = [_rec(100 * (i + 1), float(i), 0.0, 0.1 * (i + 1), 0.0) for i in range(10)]
    p = summarize(2.0, recs, start_s=0.0, num_rejected=3)
    ttft = [0.1 * (i + 1) for i in range(10)]
    assert p["completed"] == 10 and p["rejected"] == 3
    assert p["ttft_mean_s"] == pytest.approx(np.mean(ttft))
    assert p["ttft_p50_s"] == pytest.approx(np.percentile(ttft, 50))
    assert p["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    last_done = 9 + 1.0 + 0.01
    assert p["duration_s"] == pytest.approx(last_done)
    assert p["prefill_tok_s"] == pytest.approx(sum(100 * (i + 1) for i in range(10)) / last_done)
    for key in ("rps", "completed", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefill_tok_s",
                "buckets"):
        assert key in p


def test_summary_of_nothing_completed():
    p = summarize(1.0, [], start_s=0.0, num_rejected=2)
    assert p["completed"] == 0 and p["ttft_mean_s"] is None and p["prefill_tok_s"] is None
    assert "rate 1 rps: 0 completed, 2 rejected" in format_point(p)


def test_bucket_edges_scale_and_stay_increasing():
    assert bucket_edges(1.0) == [512, 1024, 2048, 4096, 8192, 16384]
    assert bucket_edges(0.1) == [51, 102, 205, 410, 819, 1638]
    assert bucket_edges(0.001) == [1, 2, 4, 8, 16]  # 512 * 0.001 and 1024 * 0.001 both round to 1


def test_buckets_split_by_prompt_length_and_average_each_part():
    recs = [_rec(100, 0.0, 1.0, 0.5, 0.1), _rec(511, 0.0, 3.0, 0.5, 0.3), _rec(512, 0.0, 0.0, 2.0, 0.0),
            _rec(20000, 0.0, 0.0, 9.0, 1.0)]
    bs = buckets(recs, bucket_edges(1.0))
    assert [b["count"] for b in bs] == [2, 1, 0, 0, 0, 0, 1]
    first = bs[0]
    assert (first["lo_tokens"], first["hi_tokens"]) == (0, 512)
    assert first["queue_mean_s"] == pytest.approx(2.0)
    assert first["compute_mean_s"] == pytest.approx(0.5)
    assert first["other_mean_s"] == pytest.approx(0.2)
    assert first["ttft_mean_s"] == pytest.approx(2.7)
    assert bs[2]["ttft_mean_s"] is None
    assert (bs[-1]["lo_tokens"], bs[-1]["hi_tokens"], bs[-1]["ttft_mean_s"]) == (16384, None, pytest.approx(10.0))
    table = format_point(summarize(1.0, recs, 0.0))
    assert "0-511" in table and ">=16384" in table and "1024-2047" not in table  # empty buckets not printed


def test_lower_bound_counts_waits_so_far_and_zero_for_the_rest():
    # two done (1 s, 3 s), one waiting since t=8 (2 s so far at t=10), one not arrived: n = 4
    assert mean_ttft_lower_bound([1.0, 3.0], [8.0], 4, 10.0) == pytest.approx(6.0 / 4)
    assert mean_ttft_lower_bound([], [], 0, 1.0) == 0.0


def _queue_ttft(capacity: float):
    """TTFT of an M/M/1-like queue: finite and increasing below capacity, infinite at or above."""
    def ttft(rate: float) -> float:
        return 0.1 / (1 - rate / capacity) if rate < capacity else math.inf
    return ttft


@pytest.mark.parametrize("start", [[1.0], [0.5, 4.0], [20.0], [9.5, 9.8]])
def test_bisection_finds_the_threshold(start):
    f = _queue_ttft(10.0)
    search = SloSearch(slo_ttft_s=0.7, max_probes=20, rel_tol=0.01, max_halvings=6)
    threshold = 10 * (1 - 1 / 7)  # 0.1 / (1 - r / 10) = 0.7
    measured = {r: f(r) for r in start}
    res = find_slo_rps(f, search, measured)
    assert res.rps <= threshold < res.upper_rps
    assert res.upper_rps / res.rps <= 1.01 + 1e-9
    assert measured[res.rps] <= 0.7 < measured[res.upper_rps]


def test_bisection_stops_after_max_probes_and_answers_a_measured_passing_rate():
    f = _queue_ttft(10.0)
    calls = []
    res = find_slo_rps(lambda r: calls.append(r) or f(r), SloSearch(1.0, max_probes=2), {1.0: f(1.0)})
    # bracketing doubles 1 -> 2, 4, 8 (pass), 16 (fails); then two midpoints: 12 and 10, both fail
    assert calls == [2.0, 4.0, 8.0, 16.0, 12.0, 10.0]
    assert (res.rps, res.upper_rps, res.num_probes) == (8.0, 10.0, 6)


def test_bisection_without_a_bracket():
    always_slow = find_slo_rps(lambda r: 5.0, SloSearch(1.0, max_halvings=2), {1.0: 5.0})
    assert (always_slow.rps, always_slow.upper_rps, always_slow.at_least_rps) == (None, 0.25, None)
    with pytest.raises(ValueError, match="at least one"):
        find_slo_rps(lambda r: 0.0, SloSearch(1.0), {})
    with pytest.raises(ValueError, match="slo_ttft_s"):
        SloSearch(0.0)


def test_the_search_doubles_until_a_rate_misses_the_slo():
    # the true SLO throughput is 40 rps and the search starts at 1: four doublings reach only 16,
    # which the search used to answer as the SLO throughput
    f = lambda r: 0.5 if r <= 40.0 else 5.0  # noqa: E731
    calls = []
    res = find_slo_rps(lambda r: calls.append(r) or f(r), SloSearch(1.0, max_probes=10, rel_tol=0.01), {1.0: f(1.0)})
    assert calls[:6] == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    assert res.rps <= 40.0 < res.upper_rps and res.upper_rps / res.rps <= 1.01 and res.at_least_rps is None


def test_an_slo_throughput_above_the_cap_is_a_bound_not_a_value():
    from moeflow.measure.slo import SloResult, format_slo

    res = find_slo_rps(lambda r: 0.1, SloSearch(1.0, max_doublings=3), {1.0: 0.1})
    assert (res.rps, res.upper_rps, res.at_least_rps, res.num_probes) == (None, None, 8.0, 3)
    assert format_slo(res.rps, res.at_least_rps) == ">= 8" and res.describe().startswith(">= 8 rps")  # bench serve
    with pytest.raises(ValueError, match="bracketed"):
        SloResult(8.0, None, 0)  # a value needs the failing rate above it


def test_slo_throughput_over_repeats_keeps_bounds_as_bounds(capsys):
    from moeflow.measure.compare_report import format_over_repeats
    from moeflow.measure.slo import MEAN, format_slo, slo_over_repeats
    from moeflow.sim.cli import print_slo_table

    exact, bound, none = ({"rps": 0.5, "upper_rps": 0.8}, {"rps": None, "upper_rps": None, "at_least_rps": 0.8},
                          {"rps": None, "upper_rps": 0.5})
    # one repeat's bound lies above the other two values: the median is known exactly
    s = slo_over_repeats([bound, exact, exact])
    assert (s["median"], s["median_at_least"], s["max"], s["max_at_least"]) == (0.5, None, None, 0.8)
    # two bounds of three: only "at least" is known about the median
    s = slo_over_repeats([bound, exact, bound])
    assert (s["median"], s["median_at_least"], s["min"]) == (None, 0.8, 0.5)
    assert format_slo(s["median"], s["median_at_least"]) == ">= 0.8"
    assert slo_over_repeats([none, exact])["median"] == 0.5  # a repeat no rate met is left out, as before
    s3 = slo_over_repeats([{"rps": 3.0, "upper_rps": 4.0}, None, {"rps": 1.0, "upper_rps": 2.0}])
    assert (s3["median"], s3["min"], s3["max"], s3["values"]) == (2.0, 1.0, 3.0, [3.0, None, 1.0])
    # the tables of bench compare and simulate print the bound
    assert format_over_repeats(s) == ">= 0.8 [0.5, >= 0.8]"
    print_slo_table({"a": {"slo_rps_by_metric": {"mean": s}}}, ["a"], (MEAN,), 4.0)
    assert ">= 0.8" in capsys.readouterr().out


def test_plot_labels_name_mode_and_layout():
    assert label({"mode": "colocated", "config": {}}) == "colocated"
    assert label({"mode": "asap", "config": {"attn_dp": 2, "attn_tp": 1, "moe_workers": 2, "dual_batch": False}}) \
        == "asap D=2 T=1 E=2 no-dual-batch"
    assert label({"mode": "dep", "config": {"dp": 4, "chunked_prefill_size": 512}}) == "dep dp=4 chunk=512"


def test_trace_summary_adds_time_per_worker_and_stage():
    from moeflow.bench.trace_summary import summarize_trace
    from moeflow.engine.trace import write_chrome_trace
    from moeflow.messages import Span
    import json
    import tempfile

    spans = [Span("attention", "attention0/main", 0.0, 1.0), Span("attention", "attention0/main", 2.0, 2.5),
             Span("experts", "moe0/main", 0.5, 3.0), Span("recv", "moe0/recv", 0.4, 0.5)]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        write_chrome_trace(spans, f.name, {"provenance": {"commit": "abc"}})
        trace = json.load(open(f.name))
        window, total = summarize_trace(trace)
    assert trace["provenance"] == {"commit": "abc"}  # a trace under docs/results carries its provenance too
    assert window == pytest.approx(3.0)
    assert total[("attention0", "main", "attention")] == pytest.approx(1.5)
    assert total[("moe0", "main", "experts")] == pytest.approx(2.5)
    assert total[("moe0", "recv", "recv")] == pytest.approx(0.1)


def test_goodput_counts_requests_within_both_slos():
    """DistServe's goodput: TTFT and TPOT both within the SLO; a one-token answer is judged by its TTFT;
    the share is over every request sent (a refused one met neither)."""
    def rec(ttft: float, tpot: float | None, n_out: int) -> RequestRecord:
        done = ttft + (tpot or 0.0) * (n_out - 1)
        return RequestRecord(10, 0.0, 0.0, ttft, None, done, num_output=n_out)

    recs = [rec(0.5, 0.05, 11), rec(0.5, 0.2, 11), rec(2.0, 0.05, 11), rec(0.5, None, 1)]
    p = summarize(1.0, recs, start_s=0.0, num_rejected=1, slo=(1.0, 0.1))
    wall = max(r.finished_s for r in recs)
    assert p["goodput_rps"] == pytest.approx(2 / wall) and p["slo_attainment"] == pytest.approx(2 / 5)
    assert "goodput_rps" not in summarize(1.0, recs, start_s=0.0)


def test_the_pareto_plot_draws_each_system_over_its_rates(tmp_path):
    from moeflow.cli import main

    def point(rps, tps, tok):
        return {"rps": rps, "tps_user_mean": tps, "tps_user_mean_ci": [tps - 1, tps + 1],
                "output_tok_s_per_process": tok, "output_tok_s_per_process_ci": [tok - 0.5, tok + 0.5]}

    result = {"systems": {"dep4": {"mode": "dep", "points": [point(0.3, 7.0, 2.0), point(0.6, 5.0, 3.0)]},
                          "pd": {"mode": "pd", "config": {"prefill": {"mode": "asap"}, "decode": {"mode": "afd"}},
                                 "points": [point(0.3, 9.0, 2.1)]}}}
    (tmp_path / "c.json").write_text(__import__("json").dumps(result))
    assert main(["bench", "plot", "--pareto", str(tmp_path / "c.json"), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert label(result["systems"]["pd"]) == "pd asap -> afd"
