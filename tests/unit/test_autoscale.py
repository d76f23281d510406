"""The autoscaling controller on recorded load windows (ints and shares): which side it grows, when it
shrinks, and that it does not flap."""
from __future__ import annotations

import dataclasses
import random

import pytest

from moeflow.autoscale_config import AutoscalePolicy
from moeflow.scheduler.autoscale import Controller, Sample, predicted_tpot

POLICY = AutoscalePolicy(tpot_slo_s=0.2, max_attention=4, max_ffn=4, interval_s=5.0, window=3)


def _run(samples: list[Sample], policy: AutoscalePolicy = POLICY) -> list:
    c = Controller(policy)
    return [d for s in samples if (d := c.observe(s)) is not None]


def _same(n: int, **kw) -> list[Sample]:
    base = dict(attention=2, ffn=2, attn_busy=0.4, attn_wait=0.0, tpot_p90_s=0.1) | kw
    return [Sample(t_s=float(t), **base) for t in range(n)]


def test_the_model_scales_each_side_by_its_share_of_the_step():
    s = Sample(0.0, 2, 2, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3)  # FFN-bound: F = 0.8
    assert predicted_tpot(s, 0.3, 2, 4, 0.02) == pytest.approx(0.3 * 0.4 / 0.8)  # F' 0.4, A 0.4
    assert predicted_tpot(s, 0.3, 4, 2, 0.02) == pytest.approx(0.3)  # attention was not the bound
    a = Sample(0.0, 2, 2, attn_busy=0.8, attn_wait=0.0, tpot_p90_s=0.3)  # attention-bound, F unknown: = A
    assert predicted_tpot(a, 0.3, 4, 2, 0.02) == pytest.approx(0.3)  # F' = A would bound it
    assert predicted_tpot(a, 0.3, 4, 4, 0.02) == pytest.approx(0.15)
    known = Sample(0.0, 2, 2, attn_busy=0.8, attn_wait=0.0, tpot_p90_s=0.3, ffn_busy=0.2)
    assert predicted_tpot(known, 0.3, 4, 2, 0.02) == pytest.approx(0.15)


def test_an_ffn_bound_deployment_over_its_slo_gets_a_daemon():
    (d,) = _run(_same(3, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3))
    assert (d.attention, d.ffn, d.reason) == (2, 3, "over_slo")
    assert d.predicted_tpot_s == pytest.approx(0.3 * (0.8 * 2 / 3) / 0.8)
    assert d.inputs["attn_wait"] == pytest.approx(0.4) and d.inputs["tpot_p90_s"] == pytest.approx(0.3)


def test_an_attention_bound_one_gets_an_instance_and_a_daemon_unless_the_daemons_are_known_idle():
    (d,) = _run(_same(3, attn_busy=0.8, tpot_p90_s=0.3))
    assert (d.attention, d.ffn) == (3, 3)  # the daemons' share unknown: taken as the instances'
    (d,) = _run(_same(3, attn_busy=0.8, tpot_p90_s=0.3, ffn_busy=0.2))
    assert (d.attention, d.ffn) == (3, 1)  # daemons busy 20%: one of the two does, the A:F ratio moves


def test_a_queue_with_full_caches_gets_an_instance_and_room_under_the_slo_gives_one_back():
    (d,) = _run(_same(3, queue=5, kv_free=0.01))
    assert (d.attention, d.ffn, d.reason) == (3, 2, "kv_room")
    (d,) = _run(_same(3, attention=3, ffn=3, attn_busy=0.2, attn_wait=0.05, tpot_p90_s=0.05))
    assert (d.attention, d.ffn, d.reason) == (2, 2, "under_slo")
    assert d.predicted_tpot_s == pytest.approx(0.05 * 0.375 / 0.25)


def test_nothing_changes_inside_the_band_before_the_window_fills_or_within_the_interval():
    assert _run(_same(3, tpot_p90_s=0.19)) == []  # under the SLO by less than the band: stays
    assert _run(_same(2, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3)) == []  # two windows of three
    c = Controller(POLICY)
    got = [c.observe(s) for s in _same(12, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3)]
    changes = [d.t_s for d in got if d is not None]
    assert changes == [2.0, 7.0]  # the membership the samples report did not change: again, interval apart
    with pytest.raises(ValueError, match="need 1 <= min_ffn <= max_ffn"):
        AutoscalePolicy(tpot_slo_s=0.2, min_ffn=3, max_ffn=2)


class Plant:
    """A deployment whose TPOT follows the model exactly, with noise: load L splits into attention work
    per instance and FFN work per daemon."""

    def __init__(self, attention_load: float, ffn_load: float, rng: random.Random):
        self.a, self.f, self.rng = attention_load, ffn_load, rng

    def sample(self, t: float, m: int, n: int) -> Sample:
        a, f = self.a / m, self.f / n
        busy, wait = a, max(0.0, f - a)
        noise = 1 + self.rng.uniform(-0.08, 0.08)
        return Sample(t, m, n, attn_busy=busy, attn_wait=wait, tpot_p90_s=0.25 * max(a, f) * noise)


@pytest.mark.parametrize("attention_load,ffn_load", [(1.6, 0.8), (0.8, 1.6), (0.4, 0.4), (2.4, 2.4)])
def test_on_a_steady_load_it_settles_without_flapping(attention_load, ffn_load):
    rng, m, n, moves = random.Random(0), 2, 2, []
    plant, c = Plant(attention_load, ffn_load, rng), Controller(POLICY)
    for t in range(300):
        d = c.observe(plant.sample(float(t), m, n))
        if d is not None:
            moves.append((d.attention - m, d.ffn - n))
            m, n = d.attention, d.ffn
    reversals = sum(1 for x, y in zip(moves, moves[1:]) if x[0] * y[0] < 0 or x[1] * y[1] < 0)
    assert reversals == 0 and len(moves) <= 4, moves
    final = plant.sample(0.0, m, n).tpot_p90_s
    assert final <= POLICY.tpot_slo_s * 1.1 or (m, n) == (POLICY.max_attention, POLICY.max_ffn), (m, n, final)


def test_a_policy_file_is_read_with_its_sampling_period_and_refused_by_the_key_that_is_wrong(tmp_path):
    from moeflow.config import ConfigError
    from moeflow.engine.autoscaler import load_policy

    good = tmp_path / "p.yaml"
    good.write_text("tpot_slo_s: 0.1\nmax_ffn: 3\nsample_s: 1.5\n")
    policy, sample_s = load_policy(str(good))
    assert (policy.tpot_slo_s, policy.max_ffn, sample_s) == (0.1, 3, 1.5)
    bad = tmp_path / "b.yaml"
    bad.write_text("tpot_slo_s: 0.1\nmax_ffns: 3\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['max_ffns'\]"):
        load_policy(str(bad))
    bad.write_text("tpot_slo_s: -1\n")
    with pytest.raises(ConfigError, match="tpot_slo_s must be > 0"):
        load_policy(str(bad))


def test_an_idle_deployment_gives_a_member_per_side_back_down_to_the_minimums():
    c, got = Controller(POLICY), []
    m, n = 3, 3
    for t in range(40):
        d = c.observe(Sample(float(t), m, n, attn_busy=0.0, attn_wait=0.0, tpot_p90_s=None))
        if d is not None:
            got.append((d.attention, d.ffn, d.reason))
            m, n = d.attention, d.ffn
    assert got == [(2, 2, "idle"), (1, 1, "idle")]
    # requests running that have not finished yet, or queued, are not idle: no evidence, no change
    assert _run(_same(6, attention=3, ffn=3, attn_busy=0.3, tpot_p90_s=None)) == []
    assert _run(_same(6, attention=3, ffn=3, attn_busy=0.0, tpot_p90_s=None, queue=2)) == []


def test_prompts_that_wait_past_the_ttft_slo_get_an_instance_and_hold_back_a_shrink():
    ttft = AutoscalePolicy(tpot_slo_s=0.2, ttft_slo_s=1.0, max_attention=4, max_ffn=4, interval_s=5.0, window=3)
    (d,) = _run(_same(3, queue=4, ttft_p90_s=3.0), ttft)
    assert (d.attention, d.ffn, d.reason) == (3, 2, "ttft") and d.inputs["ttft_p90_s"] == 3.0
    assert _run(_same(3, queue=0, ttft_p90_s=3.0), ttft) == []  # slow prompts, none waiting: not the instances
    quiet = dict(attention=3, ffn=3, attn_busy=0.2, attn_wait=0.05, tpot_p90_s=0.05)
    assert _run(_same(3, ttft_p90_s=0.95, **quiet), ttft) == []  # TPOT has room, TTFT within the band: stays
    (d,) = _run(_same(3, ttft_p90_s=0.5, **quiet), ttft)
    assert d.reason == "under_slo"
    (d,) = _run(_same(3, ttft_p90_s=0.95, **quiet))  # without a TTFT SLO only TPOT decides
    assert d.reason == "under_slo"


def test_the_window_the_engine_and_the_simulator_feed():
    from moeflow.scheduler.load_window import LoadWindow

    w = LoadWindow(10.0)
    w.step(busy_s=3.0, wait_s=1.0)
    for t in (10.5, 10.7, 10.9):
        w.token("a", t)
    w.token("b", 11.0)
    w.finished("a", arrival_s=10.0)
    w.finished("b", arrival_s=10.2)  # one token: a TTFT, no TPOT
    assert w.due(12.0, 2.0) and not w.due(11.9, 2.0)
    s = w.sample(12.0, attention=2, ffn=1, queue=3, free_kv_blocks=25, kv_blocks=100)
    assert (s.attn_busy, s.attn_wait, s.queue, s.kv_free) == (0.75, 0.25, 3, 0.25)
    assert s.tpot_p90_s == pytest.approx(0.2) and s.ttft_p90_s == pytest.approx(0.5)  # p90 of [0.5, 0.8]: nearest rank
    assert w.sample(14.0, 2, 1, 0, 100, 100).tpot_p90_s is None  # the next window starts empty


def test_a_queue_that_ages_past_the_ttft_slo_adds_instances_in_proportion_before_any_finish():
    p = AutoscalePolicy(tpot_slo_s=0.2, ttft_slo_s=1.0, max_attention=16, max_ffn=4, interval_s=5.0, window=1,
                        max_step=4)
    # nothing finished yet (no TPOT, no TTFT), a prompt placed 2.5 s ago and not begun: 2 x (2.5 - 1) -> 3 more
    (d,) = _run([Sample(0.0, 2, 2, attn_busy=0.9, attn_wait=0.0, tpot_p90_s=None, queue=0, queue_wait_s=2.5)], p)
    assert (d.attention, d.ffn, d.reason) == (5, 2, "ttft")
    (d,) = _run([Sample(0.0, 8, 2, attn_busy=0.9, attn_wait=0.0, tpot_p90_s=0.1, queue=9, queue_wait_s=3.0)], p)
    assert d.attention == 12  # 8 x 2 = 16 wanted, at most max_step = 4
    assert _run([Sample(0.0, 2, 2, attn_busy=0.9, attn_wait=0.0, tpot_p90_s=0.1, queue=1, queue_wait_s=0.5)], p) == []


def test_the_oldest_unanswered_request_counts_a_groups_backlog_the_waiting_queue_does_not_show():
    from moeflow.core import Request, SamplingParams
    from moeflow.scheduler.load_window import oldest_unanswered

    class Pool:  # what the function reads of a RequestPool
        requests = {}

    pool = Pool()
    assert oldest_unanswered(pool) is None
    a, b = (Request(i, range(4), SamplingParams(max_tokens=4), arrival_s=t) for i, t in (("a", 1.0), ("b", 2.0)))
    pool.requests = {"a": a, "b": b}
    assert oldest_unanswered(pool) == 1.0
    a.output_token_ids.append(7)  # answered: its wait is over
    assert oldest_unanswered(pool) == 2.0


def test_a_shrink_keeps_the_kv_in_use_within_the_instances_left_and_waits_for_an_empty_queue():
    fast = dict(attention=3, ffn=3, attn_busy=0.2, attn_wait=0.05, tpot_p90_s=0.05)
    # 60% of three caches in use: two would hold 90%, over 1 - band (85%); the daemons may still go
    (d,) = _run(_same(3, **fast, kv_free=0.4))
    assert (d.attention, d.ffn, d.reason) == (3, 2, "under_slo")
    assert d.inputs["kv_used_after"] == pytest.approx(0.6)
    (d,) = _run(_same(3, **fast, kv_free=0.5))  # 50%: two hold 75%
    assert (d.attention, d.reason) == (2, "under_slo") and d.inputs["kv_used_after"] == pytest.approx(0.75)
    assert _run(_same(3, **fast, kv_free=0.5, queue=2)) == []  # requests wait: capacity is short, not spare


def test_kv_in_use_that_grows_adds_the_instances_it_will_need_by_the_next_chance_to_act():
    room = AutoscalePolicy(tpot_slo_s=0.2, max_attention=16, max_ffn=4, interval_s=5.0, window=3, max_step=4)
    rising = [Sample(float(t), 4, 2, attn_busy=0.4, attn_wait=0.0, tpot_p90_s=0.1, kv_free=f)
              for t, f in enumerate((0.6, 0.4, 0.2))]
    (d,) = _run(rising, room)  # 1.6 -> 3.2 instances' worth in 2 s: 7.2 by 5 s from now, 8.5 to keep 15% free
    assert (d.attention, d.ffn, d.reason) == (8, 2, "kv_room")  # 4 more: max_step
    assert d.inputs["kv_need"] == pytest.approx(7.2)
    (d,) = _run(_same(3, attention=4, kv_free=0.12), room)  # steady at 88% used: one more keeps 15% free
    assert (d.attention, d.reason) == (5, "kv_room")
    (d,) = _run(rising, dataclasses.replace(room, max_step=1))  # one at a time: one whatever the need
    assert (d.attention, d.reason) == (5, "kv_room")


def test_an_ffn_bound_deployment_out_of_kv_room_gets_an_instance_and_a_daemon_in_one_change():
    (d,) = _run(_same(3, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3, queue=5, kv_free=0.01))
    assert (d.attention, d.ffn, d.reason) == (3, 3, "kv_room")  # predicted 0.2 s at 3:3 against 0.3 at 3:2
    assert d.predicted_tpot_s == pytest.approx(0.2)


def test_at_the_instances_maximum_with_full_caches_a_daemon_comes_without_an_instance_going():
    # 4:2, FFN-bound: 3:3 and 4:3 predict the same TPOT; fewer processes would pick 3:3, whose instances
    # cannot hold the KV in use (99% of four caches): the request on the fourth would queue
    full = dict(attention=4, ffn=2, attn_busy=0.4, attn_wait=0.4, tpot_p90_s=0.3, queue=3, kv_free=0.01)
    (d,) = _run(_same(3, **full))
    assert (d.attention, d.ffn, d.reason) == (4, 3, "over_slo")
    (d,) = _run(_same(3, **(full | dict(queue=0, kv_free=0.5))))  # half the KV used: three hold 67%
    assert (d.attention, d.ffn, d.reason) == (3, 3, "over_slo")


def test_a_shrink_leaves_room_for_the_kv_the_trend_brings():
    quiet = dict(attention=3, ffn=3, attn_busy=0.2, attn_wait=0.05, tpot_p90_s=0.05)
    rising = [Sample(float(t), **quiet, kv_free=f) for t, f in enumerate((0.55, 0.52, 0.5))]
    (d,) = _run(rising)  # 1.5 instances' worth now, 1.875 by 5 s: two would be 94% used; the daemons may go
    assert (d.attention, d.ffn, d.reason) == (3, 2, "under_slo") and d.inputs["kv_need"] == pytest.approx(1.875)
    (d,) = _run(_same(3, **quiet, kv_free=0.5))  # steady at half: two hold 75%, and both sides may go
    assert (d.attention, d.ffn, d.reason) == (2, 2, "under_slo")


def test_a_membership_left_for_falling_short_is_not_shrunk_back_to_within_the_hold():
    # 2:1 is over the SLO (the daemon the bound): a daemon more; at 2:2 the TPOT halves and the model
    # predicts 2:1 would do again, which the drift makes false: the hold keeps 2:2
    short = dict(attention=2, ffn=1, attn_busy=0.3, attn_wait=0.3, tpot_p90_s=0.3)
    fine = dict(attention=2, ffn=2, attn_busy=0.5, attn_wait=0.0, tpot_p90_s=0.1, ffn_busy=0.3)
    trace = [Sample(float(t), **short) for t in range(3)] + [Sample(float(t), **fine) for t in range(3, 62)]
    ds = _run(trace)
    assert [(d.attention, d.ffn, d.reason) for d in ds] == [(2, 2, "over_slo")]
    later = trace + [Sample(float(t), **fine) for t in range(62, 70)]  # past hold_s (60 s): it may go, and
    assert [(d.attention, d.ffn) for d in _run(later)][-1] == (2, 1)  # predicted 0.12 s (1:2 and 1:1 0.2 s)
    no_hold = dataclasses.replace(POLICY, hold_s=0.0)
    assert [(d.attention, d.ffn) for d in _run(trace, no_hold)][1] == (2, 1)  # without it: back at once


def test_one_systems_policy_key_is_overridden_from_the_command_line():
    from moeflow.config import ConfigError
    from moeflow.experiment.serve import apply_overrides, load_experiment
    exp = load_experiment("configs/elastic-afd-here.yaml", ("systems.elastic.autoscale.hold_s=0",))
    assert dict(exp.systems["elastic"].autoscale)["hold_s"] == 0
    assert dict(exp.systems["elastic"].autoscale)["interval_s"] == 10  # the rest as the file has it
    with pytest.raises(ConfigError, match="systems.NAME.autoscale.KEY"):
        apply_overrides({"systems": {"a": {"mode": "afd"}}}, ("systems.b.autoscale.hold_s=0",))
