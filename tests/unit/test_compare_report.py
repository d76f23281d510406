"""``bench compare``'s report on hand-built repeats: the verdict is decided on the paired interval
and says so, and a saturation probe that did not saturate is reported as such, never as a
saturation throughput, share of capacity or ratio."""
from __future__ import annotations

from moeflow.measure import compare_report as report

SEEDS = (0, 1, 2)


def _system(ttft_s: list[float], sat_tok_s: list[float], saturated: list[bool], sat_rps: float = 1.6) -> dict:
    reps = [{"seed": seed, "probes": [], "slo": {},
             "sweep": [{"rps": 0.5, "ttft_mean_s": t, "completed": 40, "failed": 0, "rejected": 0}],
             "saturation": {"rps": sat_rps, "prefill_tok_s": tok, "saturated": ok}}
            for seed, t, tok, ok in zip(SEEDS, ttft_s, sat_tok_s, saturated)]
    return {"points": report.aggregate_points(reps), "repeats": reps, "slo_rps_by_metric": {},
            "saturation": report.saturation_summary(reps, capacity_tok_s=1000.0)}


def _markdown(systems: dict, pairs: list[tuple[str, str]]) -> tuple[str, list[dict]]:
    comparisons = [report.comparison(a, systems[a], b, systems[b], "mean") for a, b in pairs]
    result = {"title": "t", "provenance": {"command": "moeflow bench compare x.yaml", "commit": "c" * 40, "date": "d",
                                           "cpu_model": "cpu", "cores": 2, "torch": "2"},
              "dtype": "float32", "repeats": len(SEEDS), "seeds": list(SEEDS), "slo_ttft_s": None,
              "systems": systems, "comparisons": comparisons,
              "capacity": {"tok_s": 1000.0, "cores": 2, "mean_prompt_tokens": 500.0, "mean_request_compute_s": 1.0}}
    return report.markdown(result), comparisons


def test_the_verdict_is_on_the_paired_interval():
    # each system's mean TTFT varies 2x from seed to seed, the ratio within a seed by 3%: the
    # systems' own intervals overlap, the paired one excludes 1 (issue 26's dep2/asap 1.285 [1.125, 1.446])
    asap = _system([2.0, 3.0, 4.0], [400, 410, 420], [True] * 3)
    dep2 = _system([2.6, 3.8, 5.2], [600, 590, 610], [True] * 3)
    md, (c,) = _markdown({"asap": asap, "dep2": dep2}, [("asap", "dep2")])
    (row,) = c["per_rate"]
    lo, hi = row["ttft_ratio_b_over_a"]["ci95"]
    assert 1 < lo < hi and asap["points"][0]["ttft_mean_s_ci"][1] > dep2["points"][0]["ttft_mean_s_ci"][0]
    assert row["verdict"] == "distinguishable"
    assert "verdicts are on the paired interval" in md and "| 0.5 | 1.289 [" in md


def test_an_unsaturated_probe_is_not_reported_as_saturation():
    fast = _system([1.0, 1.1, 1.2], [480, 500, 490], [False] * 3, sat_rps=25.6)
    slow = _system([1.5, 1.6, 1.7], [600, 610, 590], [True] * 3, sat_rps=3.2)
    md, (c,) = _markdown({"fast": fast, "slow": slow}, [("fast", "slow")])
    assert "Saturation prefill tokens/s fast/slow" not in md and "No saturation ratio: fast not saturated at 25.6 rps" in md
    assert "saturation_ratio_a_over_b" not in c and c["not_saturated_at_rps"] == {"fast": 25.6}
    assert fast["saturation"]["saturated"] is False and "capacity_fraction" not in fast["saturation"]
    fast_row = next(line for line in md.splitlines() if line.startswith("| fast | 25.6 |"))
    assert "not saturated at 25.6 rps (served 490" in fast_row and "%" not in fast_row.split("|")[4]
    slow_row = next(line for line in md.splitlines() if line.startswith("| slow | 3.2 |"))
    assert "60.0%" in slow_row  # the saturated one keeps its share of capacity
