"""The controller of a deployment of ranks (dep's EP size, dwdp's ranks) on recorded load windows: the
expert load's imbalance it predicts from the placement a change would make, the memory floor, when it
grows and shrinks, and that it does not flap."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from moeflow.autoscale_config import EpAutoscalePolicy, policy_from
from moeflow.config import ConfigError
from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.autoscale_ep import (EpController, EpSample, imbalance, imbalance_at, memory_floor,
                                            predicted_tpot)
from moeflow.scheduler.load_window import EpWindow

POLICY = EpAutoscalePolicy(tpot_slo_s=0.05, ttft_slo_s=2.0, max_ranks=6, interval_s=5.0, window=3)


def _run(samples: list[EpSample], policy: EpAutoscalePolicy = POLICY, floor: int = 1, procs: int = 1) -> list:
    c = EpController(policy, floor, procs)
    return [d for s in samples if (d := c.observe(s)) is not None]


def _same(n: int, t0: float = 0.0, **kw) -> list[EpSample]:
    base = dict(ranks=3, batch=20.0, tpot_p90_s=0.04, ttft_p90_s=0.5, kv_free=0.5) | kw
    return [EpSample(t_s=t0 + t, **base) for t in range(n)]


def test_the_imbalance_is_the_hottest_devices_load_over_the_mean_for_the_placement_a_change_makes():
    m = ExpertMap.contiguous(8, 4, 1)  # 2 experts per device, 2 slots each
    assert imbalance(m, [[1.0] * 8], 4) == pytest.approx(1.0)
    hot = [[9.0, 1, 1, 1, 1, 1, 1, 1]]  # device 0 holds experts 0 and 1: 10 of 16 tokens, the mean 4
    assert imbalance(m, hot, 4) == pytest.approx(10 / 4)
    # two devices fewer: the survivors take what only the leavers held in their coldest spare slots
    # (none spare here: 4 slots for 8 experts) -> the experts cannot be held
    assert math.isnan(imbalance(m, hot, 2))
    # a fifth device's two slots take replicas of experts 0 and 1 (the most load per copy): device 0 and
    # the joiner each carry 4.5 + 0.5 of the 16 tokens, the mean device 16 / 5
    assert imbalance(m, hot, 5) == pytest.approx((4.5 + 0.5) / (16 / 5))
    assert imbalance(m, [[0.0] * 8], 5) == 1.0  # no load seen: balanced
    assert imbalance_at(m, hot, range(3, 6))[1] == pytest.approx(2.5)
    assert memory_floor(m) == 4
    assert memory_floor(ExpertMap.contiguous(8, 4, 1, num_redundant=4)) == 3  # 3 slots each: 3 devices hold 9


def test_the_tpot_prediction_carries_the_hottest_devices_load_at_the_new_rank_count():
    s = EpSample(0.0, 2, batch=30.0, tpot_p90_s=0.05, imbalance=(1.0, 1.2, 1.8))
    x, x_up = 30.0 * 1.2, 30.0 * 2 / 3 * 1.8
    assert predicted_tpot(s, 3, (0.02, 0.001)) == pytest.approx(0.05 * (0.02 + 0.001 * x_up) / (0.02 + 0.001 * x))
    assert predicted_tpot(s, 1, None) == pytest.approx(0.05 * 60.0 * 1.0 / x)  # proportional
    assert math.isnan(predicted_tpot(dataclasses.replace(s, imbalance=(float("nan"), 1.2, 1.8)), 1, None))
    assert math.isnan(predicted_tpot(dataclasses.replace(s, tpot_p90_s=None), 3, None))


def test_over_the_slo_a_rank_is_added_where_the_experts_let_it_gain_and_not_where_a_hot_expert_sets_the_step():
    (d,) = _run(_same(3, tpot_p90_s=0.08))  # balanced: 3 -> 4 predicts 0.06, a gain over the band
    assert (d.ranks, d.reason) == (4, "over_slo")
    assert d.predicted_tpot_s == pytest.approx(0.08 * 3 / 4)
    # one expert takes most tokens: a fourth rank spreads the requests but the hottest device keeps its load
    assert _run(_same(3, tpot_p90_s=0.08, imbalance=(1.0, 1.5, 2.0))) == []


def test_a_growth_passes_over_a_joiner_that_would_become_the_hottest_device():
    # DeepSeek-R1's skew from 8 ranks: resize fills a ninth rank with copies of the hottest experts
    policy = dataclasses.replace(POLICY, max_ranks=16, max_step=3)
    imb = (float("nan"), 1.41, 2.07, 1.72, 1.5)  # at 7, 8, 9, 10, 11 ranks
    assert EpController(policy).sizes(8) == range(7, 12)
    (d,) = _run(_same(3, ranks=8, tpot_p90_s=0.08, imbalance=imb), policy, floor=8)
    assert (d.ranks, d.reason) == (11, "over_slo")  # 9: slower (1.84 / 1.41), 10: a 2% gain, 11: 23%
    assert d.predicted_tpot_s == pytest.approx(0.08 * 1.5 * 8 / 11 / 1.41)
    (d,) = _run(_same(3, ranks=8, kv_free=0.05, imbalance=imb), policy, floor=8)
    assert (d.ranks, d.reason) == (10, "kv_room")  # the fewest more whose step is no slower by the band
    (d,) = _run(_same(3, ranks=8, kv_free=0.05, imbalance=(float("nan"), 1.41, 2.07, 2.3, 2.3)), policy, floor=8)
    assert d.ranks == 9  # none within reach keeps the step: the one rank KV room needs


def test_kv_room_and_ttft_add_ranks_and_the_budget_and_floor_bound_every_change():
    (d,) = _run(_same(3, kv_free=0.05))
    assert (d.ranks, d.reason) == (4, "kv_room")
    (d,) = _run(_same(3, queue=5, queue_wait_s=6.0), dataclasses.replace(POLICY, max_step=4))
    assert (d.ranks, d.reason) == (6, "ttft")  # 3 x (6 / 2 - 1) = 6 more, at most 4, at most max_ranks
    assert _run(_same(3, kv_free=0.05), dataclasses.replace(POLICY, max_processes=6), procs=2) == []  # 4 x 2 > 6
    # idle, it gives ranks back one at a time, never below the floor the experts' memory sets
    idle = _same(3, batch=0.0, tpot_p90_s=None, ttft_p90_s=None)
    assert [d.ranks for d in _run(idle)] == [2]
    assert _run(idle, floor=3) == []


def test_kv_filling_fast_adds_the_ranks_it_will_need_by_the_next_chance_to_act():
    policy = dataclasses.replace(POLICY, max_ranks=16, max_step=3)
    steady = [dataclasses.replace(x, ranks=8, kv_free=0.2) for x in _same(3)]
    assert _run(steady, policy) == []  # 20% free and not filling: nothing to do yet
    # in use: 4.0, 5.2, 6.4 ranks' worth over 2 s; by interval_s (5 s) on, 12.4: 15 ranks keep the band,
    # at most max_step (3) more
    rising = [dataclasses.replace(x, ranks=8, kv_free=f) for x, f in zip(_same(3), (0.5, 0.35, 0.2))]
    (d,) = _run(rising, policy)
    assert (d.ranks, d.reason) == (11, "kv_room")
    slow = [dataclasses.replace(x, ranks=8, kv_free=f) for x, f in zip(_same(3), (0.23, 0.215, 0.2))]
    (d,) = _run(slow, policy)  # 6.4 + 0.12 x 5 = 7.0 over 8 x 0.85: the one rank it needs
    assert (d.ranks, d.reason) == (9, "kv_room")


def test_under_the_slo_a_rank_goes_where_the_prediction_and_the_kv_caches_allow():
    (d,) = _run(_same(3, tpot_p90_s=0.02))
    assert (d.ranks, d.reason) == (2, "under_slo")
    assert d.predicted_tpot_s == pytest.approx(0.03)
    assert _run(_same(3, tpot_p90_s=0.02, kv_free=0.3)) == []  # 0.7 x 3/2 used: no room left
    assert _run(_same(3, tpot_p90_s=0.02, queue=1)) == []
    assert _run(_same(3, tpot_p90_s=0.02, ttft_p90_s=1.9)) == []  # TTFT within the band of its SLO
    assert _run(_same(3, tpot_p90_s=0.04)) == []  # 2 ranks: 0.06 predicted


def test_no_shrink_back_within_the_hold_to_a_rank_count_left_short_and_no_flapping_on_noise():
    c = EpController(POLICY)
    assert c.observe(_same(3, kv_free=0.05)[0]) is None
    decisions = [d for s in _same(3, kv_free=0.05) + _same(3, t0=10.0, ranks=4, tpot_p90_s=0.01)
                 if (d := c.observe(s)) is not None]
    assert [(d.ranks, d.reason) for d in decisions] == [(4, "kv_room")]  # 3 is held: it ran out of KV there
    rng = random.Random(0)
    noisy = [EpSample(float(t), 3, 20.0 * rng.uniform(0.9, 1.1), 0.04 * rng.uniform(0.9, 1.1), 0.5, kv_free=0.5)
             for t in range(300)]
    assert _run(noisy) == []


def test_the_window_accounts_the_ranks_and_the_policy_is_validated():
    w = EpWindow(0.0)
    w.step(3.0, 0.0)
    w.decoding(4, 0.0)
    w.request(1.0, 2.0, 11, 0.5)
    s = w.sample_ep(2.0, 2, 1, queue=1, free_kv_blocks=30, kv_blocks=40, oldest_unanswered_s=1.5,
                    imbalance=(1.0, 1.1, 1.3))
    assert (s.ranks, s.batch, s.busy, s.tpot_p90_s, s.ttft_p90_s, s.kv_free, s.queue_wait_s) == \
        (2, 2.0, 0.75, pytest.approx(0.1), 0.5, 0.75, 0.5)
    assert s.imbalance == (1.0, 1.1, 1.3)
    p, sample_s = policy_from({"tpot_slo_s": 0.05, "max_ranks": 4, "sample_s": 3}, "x", EpAutoscalePolicy)
    assert (p.max_ranks, sample_s) == (4, 3.0)
    for bad, word in (({"tpot_slo_s": 0}, "tpot_slo_s"), ({"tpot_slo_s": 1, "min_ranks": 3, "max_ranks": 2}, "min_ranks"),
                      ({"tpot_slo_s": 1, "history": 1}, "history"), ({"tpot_slo_s": 1, "max_ffn": 2}, "max_ffn")):
        with pytest.raises(ConfigError, match=word):
            policy_from(bad, "x", EpAutoscalePolicy)
