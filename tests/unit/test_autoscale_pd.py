"""The pd controller (xPyD by rate matching) on recorded load windows: which side it grows, when it
shrinks, the decode step model it fits, and that it does not flap."""
from __future__ import annotations

import dataclasses
import random

import pytest

from moeflow.autoscale_config import PdAutoscalePolicy, policy_from
from moeflow.config import ConfigError
from moeflow.scheduler.autoscale_pd import PdController, PdSample, fit_step, predicted_tpot
from moeflow.scheduler.load_window import PdWindow

POLICY = PdAutoscalePolicy(tpot_slo_s=0.05, ttft_slo_s=2.0, max_prefill=4, max_decode=4, interval_s=5.0, window=3)


def _run(samples: list[PdSample], policy: PdAutoscalePolicy = POLICY, procs=(1, 1)) -> list:
    c = PdController(policy, *procs)
    return [d for s in samples if (d := c.observe(s)) is not None]


def _same(n: int, t0: float = 0.0, **kw) -> list[PdSample]:
    base = dict(prefill=2, decode=2, prefill_busy=0.5, decode_batch=20.0, tpot_p90_s=0.04, ttft_p90_s=0.5) | kw
    return [PdSample(t_s=t0 + t, **base) for t in range(n)]


def test_the_step_model_is_fitted_on_the_windows_and_falls_back_to_proportional():
    line = [(b, 0.02 + 0.001 * b) for b in (10.0, 20.0, 30.0)]
    assert fit_step(line) == pytest.approx((0.02, 0.001))
    assert fit_step(line[:2]) is None  # too few windows
    assert fit_step([(20.0, 0.03), (21.0, 0.031), (22.0, 0.032)]) is None  # batches too alike to fit
    assert fit_step([(10.0, 0.05), (20.0, 0.04), (30.0, 0.03)]) == pytest.approx((0.04, 0.0))  # no growth seen: flat
    assert fit_step([(10.0, 0.005), (20.0, 0.02), (30.0, 0.035)])[0] == 0.0  # through the origin, not below it
    s = PdSample(0.0, 1, 2, 0.5, decode_batch=30.0, tpot_p90_s=0.05)
    assert predicted_tpot(s, 3, (0.02, 0.001)) == pytest.approx(0.05 * (0.02 + 0.001 * 20) / (0.02 + 0.03))
    assert predicted_tpot(s, 1, None) == pytest.approx(0.1)  # proportional: the whole batch on one


def test_a_prefill_side_over_its_target_utilization_gets_the_instances_rate_matching_asks_for():
    (d,) = _run(_same(3, prefill_busy=0.95))  # 2 x 0.95 / 0.7 -> 3
    assert (d.prefill, d.decode, d.reason) == (3, 2, "prefill_rate_up")
    (d,) = _run(_same(3, prefill_busy=0.99, prefill=1), dataclasses.replace(POLICY, max_step=1))
    assert d.prefill == 2  # 1 x 0.99 / 0.7 -> 2
    (d,) = _run(_same(3, prefill_busy=1.0, prefill=2), dataclasses.replace(POLICY, max_step=3, target_utilization=0.5))
    assert d.prefill == 4  # 2 x 1.0 / 0.5 -> 4, two more at once
    assert _run(_same(3, prefill_busy=0.78)) == []  # over the target by less than the band


def test_prompts_that_wait_past_the_ttft_slo_add_prefill_unless_the_decode_side_holds_them():
    (d,) = _run(_same(3, queue=4, ttft_p90_s=3.0))
    assert (d.prefill, d.reason) == (3, "ttft")
    (d,) = _run(_same(3, queue=4, ttft_p90_s=3.0, handoffs_waiting=3, decode_kv_free=0.01))
    assert (d.prefill, d.decode, d.reason) == (2, 3, "kv_room")  # prompts wait because prefilled KV cannot leave


def test_the_decode_side_over_its_slo_grows_where_the_model_predicts_a_gain():
    c = PdController(POLICY)
    for t, b in enumerate((10.0, 20.0, 30.0)):  # windows along t(B) = 0.02 + 0.002 B: their mean over the SLO
        d = c.observe(PdSample(float(t), 2, 2, 0.5, b, 0.02 + 0.002 * b))
    assert (d.prefill, d.decode, d.reason) == (2, 3, "over_slo")
    assert d.inputs["fit"] == pytest.approx((0.02, 0.002))
    assert d.predicted_tpot_s == pytest.approx(0.02 + 0.002 * 20.0 * 2 / 3)  # the mean batch 20 over three
    flat = PdController(POLICY)
    for t, b in enumerate((10.0, 20.0, 30.0)):  # TPOT does not move with the batch: another instance buys nothing
        flat.observe(PdSample(float(t), 2, 2, 0.5, b, 0.07))
    assert [flat.observe(PdSample(float(t), 2, 2, 0.5, 30.0, 0.07)) for t in (3, 4, 5)] == [None] * 3
    (d,) = _run(_same(3, decode_batch=30.0, tpot_p90_s=0.07))  # no spread to fit: proportional, 0.07 x 2/3
    assert (d.prefill, d.decode, d.reason) == (2, 3, "over_slo")
    assert d.predicted_tpot_s == pytest.approx(0.07 * 2 / 3)


def test_decode_caches_with_less_than_the_band_free_get_an_instance_before_they_fill():
    (d,) = _run(_same(3, decode_kv_free=0.1))  # within the SLO, nothing waiting yet
    assert (d.prefill, d.decode, d.reason) == (2, 3, "kv_room")
    assert _run(_same(3, decode_kv_free=0.2)) == []


def test_a_decode_shrink_keeps_the_slo_and_the_kv_room_with_the_band_to_spare():
    (d,) = _run(_same(3, decode=3, tpot_p90_s=0.02))  # proportional: 0.02 x 3/2 = 0.03 <= 0.05 x 0.925
    assert (d.prefill, d.decode, d.reason) == (2, 2, "under_slo")
    assert _run(_same(3, decode=3, tpot_p90_s=0.035)) == []  # 0.0525 would break the SLO
    assert _run(_same(3, decode=3, tpot_p90_s=0.02, decode_kv_free=0.4)) == []  # used 0.6 -> 0.9 > 0.85
    assert _run(_same(3, decode=3, tpot_p90_s=0.02, handoffs_waiting=1)) == []


def test_an_idle_deployment_gives_one_instance_per_side_back_down_to_the_minimums():
    (d,) = _run(_same(3, prefill=3, decode=2, prefill_busy=0.0, decode_batch=0.0, tpot_p90_s=None, ttft_p90_s=None))
    assert (d.prefill, d.decode, d.reason) == (2, 1, "idle+idle")
    assert _run(_same(3, prefill=1, decode=1, prefill_busy=0.0, decode_batch=0.0, tpot_p90_s=None)) == []


def test_the_budget_counts_each_sides_processes():
    p = dataclasses.replace(POLICY, max_processes=8)
    (d,) = _run(_same(3, prefill=2, decode=1, prefill_busy=0.95, tpot_p90_s=0.07), p, procs=(2, 2))
    assert (d.prefill, d.decode) == (2, 2)  # both would be 10 processes: the decode side's alone fits
    assert PdController(POLICY, 4, 8).budget == 4 * 4 + 4 * 8


def test_a_membership_left_for_falling_short_is_not_shrunk_back_to_within_the_hold():
    p = dataclasses.replace(POLICY, hold_s=60.0)
    c = PdController(p)
    ups = [c.observe(s) for s in _same(3, prefill=1, prefill_busy=0.99)]
    assert ups[-1].prefill == 2
    quiet = _same(12, t0=10.0, prefill=2, prefill_busy=0.2)  # 2 x 0.2 / 1 = 0.4 <= 0.7: one would do
    assert [d for s in quiet if (d := c.observe(s)) is not None] == []  # within the hold of leaving 1 short
    (d,) = [d for s in _same(3, t0=80.0, prefill=2, prefill_busy=0.2) if (d := c.observe(s)) is not None]
    assert (d.prefill, d.reason) == (1, "prefill_rate_down")


@pytest.mark.parametrize("busy", [0.4, 0.6, 0.8])
def test_on_a_steady_load_it_settles_without_flapping(busy):
    rng = random.Random(7)
    c, x, moves = PdController(dataclasses.replace(POLICY, hold_s=0.0)), 1, []
    for t in range(300):
        work = busy * 2  # two instances' worth at this busy share
        s = PdSample(float(t), x, 2, min(1.0, work / x * rng.uniform(0.92, 1.08)), 20.0, 0.04, 0.5)
        if (d := c.observe(s)) is not None:
            moves.append(d.prefill)
            x = d.prefill
    assert len(moves) <= 2 and all(b > a for a, b in zip([1] + moves, moves))  # up only, never back


def test_the_window_integrates_the_decode_batch_and_normalises_the_prefill_busy():
    w = PdWindow(0.0)
    w.decoding(4, 0.0)
    w.decoding(8, 5.0)  # 4 for 5 s, 8 for 5 s
    w.step(6.0, 0.0)  # prefill compute seconds over the window, all processes
    w.request(1.0, 4.0, 4, 0.5)  # TPOT 1 s, TTFT 0.5 s
    s = w.sample_pd(10.0, prefill=1, decode=2, prefill_processes=3, queue=1, handoffs_waiting=2, free_kv_blocks=25,
                    kv_blocks=100, oldest_unanswered_s=7.0)
    assert s.decode_batch == pytest.approx(60.0 / 10.0 / 2)
    assert s.prefill_busy == pytest.approx(6.0 / (10.0 * 3))
    assert (s.tpot_p90_s, s.ttft_p90_s, s.queue_wait_s, s.decode_kv_free) == (1.0, 0.5, 3.0, 0.25)
    nxt = w.sample_pd(20.0, 1, 2, 3, 0, 0, 100, 100)
    assert nxt.decode_batch == pytest.approx(8 * 10.0 / 10.0 / 2) and nxt.tpot_p90_s is None


def test_a_pd_policy_is_refused_by_the_key_that_is_wrong():
    p, every = policy_from({"tpot_slo_s": 0.05, "ttft_slo_s": 2, "max_prefill": 3, "sample_s": 5}, "x", PdAutoscalePolicy)
    assert (p.max_prefill, every) == (3, 5.0)
    with pytest.raises(ConfigError, match="unknown keys \\['max_ffn'\\]"):
        policy_from({"tpot_slo_s": 0.05, "ttft_slo_s": 2, "max_ffn": 3}, "x", PdAutoscalePolicy)
    with pytest.raises(ConfigError, match="ttft_slo_s"):
        policy_from({"tpot_slo_s": 0.05}, "x", PdAutoscalePolicy)
    with pytest.raises(ConfigError, match="target_utilization"):
        policy_from({"tpot_slo_s": 0.05, "ttft_slo_s": 2, "target_utilization": 1.0}, "x", PdAutoscalePolicy)
