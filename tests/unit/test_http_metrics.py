"""vLLM-named serving metrics (``bench.http_metrics``) on synthetic timings, and their parsers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moeflow.bench.demo import side_by_side
from moeflow.bench.http_metrics import (RequestOutcome, compute_metrics, format_table, parse_goodput,
                                        parse_percentile_metrics, parse_percentiles)

ALL = ("ttft", "tpot", "itl", "e2el")


def _outcomes() -> list[RequestOutcome]:
    return [
        # 5 tokens, first at 0.1 s, then 4 chunks 0.05 s apart: TPOT (0.3 - 0.1) / 4 = 0.05
        RequestOutcome(10, True, 0.1, 0.3, (0.05, 0.05, 0.05, 0.05), 5),
        # 3 tokens in 2 chunks (two tokens arrived together): TPOT (0.6 - 0.2) / 2 = 0.2, one ITL gap of 0.4
        RequestOutcome(20, True, 0.2, 0.6, (0.4,), 3),
        # 1 token: no TPOT, no ITL
        RequestOutcome(30, True, 0.5, 0.5, (), 1),
        RequestOutcome(40, False, error="HTTP 500"),
    ]


def test_definitions_match_vllm():
    m = compute_metrics(_outcomes(), 2.0, ALL, (50.0, 99.0, 99.9))
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 60, 9)
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 500]))
    assert m["mean_tpot_ms"] == pytest.approx(125) and m["median_tpot_ms"] == pytest.approx(125)
    assert m["mean_itl_ms"] == pytest.approx(np.mean([50, 50, 50, 50, 400]))  # gaps pooled over requests
    assert m["median_e2el_ms"] == pytest.approx(500)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 500], 99))
    assert "p99.9_itl_ms" in m and "p50_e2el_ms" in m and "request_goodput" not in m


def test_goodput_counts_requests_within_every_slo():
    # TTFT <= 250 ms keeps requests 1 and 2; TPOT <= 100 ms drops request 2 (200 ms) and keeps
    # request 3, whose TPOT counts as 0 (one token), except that its TTFT (500) fails.
    assert compute_metrics(_outcomes(), 2.0, goodput_ms={"ttft": 250})["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(_outcomes(), 2.0, goodput_ms={"tpot": 100})["request_goodput"] == pytest.approx(1.0)
    both = compute_metrics(_outcomes(), 2.0, goodput_ms={"ttft": 250, "tpot": 100})
    assert both["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(_outcomes(), 2.0, goodput_ms={"e2el": 1000})["request_goodput"] == pytest.approx(1.5)


def test_empty_run_reports_zeros():
    m = compute_metrics([RequestOutcome(5, False, error="x")], 1.0, ALL)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0


def test_outcome_validates_and_tpot():
    with pytest.raises(ValueError, match="ttft"):
        RequestOutcome(1, True, 0.5, 0.2, (), 2)
    assert RequestOutcome(1, True, 0.1, 0.1, (), 1).tpot_s is None


def test_parsers():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentile_metrics("ttft, e2el") == ("ttft", "e2el")
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_percentile_metrics("ttft,foo")
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
    with pytest.raises(ValueError, match="--metric-percentiles"):
        parse_percentiles("100")


def test_tables():
    m = compute_metrics(_outcomes(), 2.0, ALL, (99.0,), {"ttft": 250})
    t = format_table(m, ALL, (99.0,)).splitlines()
    assert t[0] == "============ Serving Benchmark Result ============" and t[-1] == "=" * 50
    assert "Successful requests:                     3" in t
    assert any(line.startswith("Request goodput (req/s):") for line in t)
    assert any(line.startswith("P99 E2EL (ms):") for line in t) and not any("P50" in line for line in t)
    m2 = compute_metrics(_outcomes(), 2.0, ALL, (50.0, 99.0))
    s = side_by_side([("a", m2), ("b", m2)]).splitlines()
    assert s[0].split() == ["a", "b"] and s[1].split()[-2:] == ["3", "3"]
    assert not math.isnan(float(s[-1].split()[-1]))
