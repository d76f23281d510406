"""The saturation probe on a fake deployment of known capacity: a probe whose first offered rate is
below capacity must end saturated at a higher rate, or say it is not saturated; the offered load
a deployment merely kept up with is never reported as its saturation throughput."""
from __future__ import annotations

import pytest

from moeflow.measure.saturation import SaturationSearch, find_saturation

PROMPT_LEN = 100
CAPACITY_TOK_S = 1000.0  # 10 rps of 100-token prompts


def _deployment(num_requests: int = 100):
    """``num_requests`` prompts offered at ``rate``: served as they arrive below capacity, at
    capacity above it; ``prefill_tok_s`` over the start to the last completion, as ``summarize``."""
    calls = []

    def measure(rate: float) -> dict:
        calls.append(rate)
        work_s = num_requests * PROMPT_LEN / CAPACITY_TOK_S
        last_done_s = max(num_requests / rate, work_s) + PROMPT_LEN / CAPACITY_TOK_S  # + the last prompt's own time
        return {"rps": rate, "completed": num_requests, "prefill_tok_s": num_requests * PROMPT_LEN / last_done_s,
                "duration_s": last_done_s}

    return measure, calls


def test_a_probe_below_capacity_raises_the_rate_until_throughput_stops_growing():
    measure, calls = _deployment()
    res = find_saturation(measure, SaturationSearch(1.6))
    # 1.6 rps is 16% of capacity: the fixed-rate probe reported its ~160 tok/s as saturation
    assert calls == [1.6, 3.2, 6.4, 12.8, 25.6]
    assert res.saturated and res.offered_rps == 25.6 > CAPACITY_TOK_S / PROMPT_LEN
    assert res.point["prefill_tok_s"] == pytest.approx(CAPACITY_TOK_S, rel=0.02)
    assert [r for r, _ in res.probes] == calls and res.probes[0][1] == pytest.approx(160, rel=0.01)
    assert res.describe().startswith("saturated at 25.6 rps: 990 tok/s")
    kept = res.to_point()
    assert kept["saturated"] is True and [p["rps"] for p in kept["saturation_probes"]] == calls


def test_a_probe_that_reaches_its_cap_says_not_saturated():
    measure, calls = _deployment()
    res = find_saturation(measure, SaturationSearch(1.6, max_raises=2))
    assert calls == [1.6, 3.2, 6.4] and not res.saturated and res.offered_rps == 6.4
    assert res.describe() == "not saturated at 6.4 rps (served 636 tok/s)"
    assert res.to_point()["saturated"] is False


def test_a_probe_already_above_capacity_confirms_it_with_one_raise():
    measure, calls = _deployment()
    res = find_saturation(measure, SaturationSearch(20.0))
    assert calls == [20.0, 40.0] and res.saturated


def test_a_queue_that_grows_is_saturation_though_throughput_still_creeps_up():
    """Few requests: batches keep getting fuller as they arrive closer together, so tok/s grows past
    10% a doubling long after the deployment fell behind; it served under half the offered rate."""
    def measure(rate: float) -> dict:
        n, batching_gain = 12, min(2.0, 1 + rate / 200)  # fuller batches: up to 2x the work per second
        duration = max(n / rate, n / (50 * batching_gain))
        return {"rps": rate, "completed": n, "prefill_tok_s": n * PROMPT_LEN / duration, "duration_s": duration}

    res = find_saturation(measure, SaturationSearch(30.0))
    # at 120 rps 12 requests took 0.15 s (80 rps served: more than half); at 240 they took 0.12 s,
    # 100 rps served of 240 offered, while tok/s still grew 25%
    assert res.saturated and res.offered_rps == 240.0 and res.probes[-1][1] == pytest.approx(1.25 * res.probes[-2][1])


def test_nothing_served_is_not_saturation():
    res = find_saturation(lambda r: {"rps": r, "completed": 0, "prefill_tok_s": None}, SaturationSearch(1.0, max_raises=1))
    assert not res.saturated
    with pytest.raises(ValueError, match="rate_factor"):
        SaturationSearch(1.0, rate_factor=1.05)
