"""Workloads that drift: the arrival rate and the prompt lengths follow their curves, with the same
draws (common random numbers) under every curve, and bad curves are refused saying why."""
from __future__ import annotations

import numpy as np
import pytest

from moeflow.measure.drift import curve_at, curve_integral, warp_arrivals
from moeflow.measure.workload import WorkloadConfig, generate_requests

RISE = ((0, 1), (500, 3), (1000, 1))  # rate x1 -> x3 at 500 s -> x1


def _cfg(**kw) -> WorkloadConfig:
    return WorkloadConfig(**(dict(kind="fixed", fixed_len=2000, rate_rps=2.0, duration_s=1000.0, seed=1) | kw))


def test_the_warp_inverts_the_curves_integral_exactly():
    t = np.array([0.0, 10.0, 250.0, 499.0, 500.0, 731.5, 999.0])
    lam = np.array([curve_integral(RISE, x) if x > 0 else 0.0 for x in t])
    assert warp_arrivals(lam, RISE, 1000.0) == pytest.approx(t, abs=1e-6)
    assert curve_integral(RISE, 1000.0) == pytest.approx(2000.0)  # 1000 s at a mean factor of 2
    assert curve_at(RISE, [-5.0, 250.0, 2000.0]).tolist() == [1.0, 2.0, 1.0]  # flat beyond the ends


def test_arrivals_follow_the_rate_curve_and_lengths_the_length_curve():
    reqs = generate_requests(_cfg(rate_curve=RISE, length_curve=((0, 1), (1000, 4))))
    a = np.array([r.arrival_s for r in reqs])
    lens = np.array([r.prompt_len for r in reqs])
    for lo in range(0, 1000, 100):
        inside = (a >= lo) & (a < lo + 100)
        want = 2.0 * (curve_integral(RISE, lo + 100) - curve_integral(RISE, lo))  # Poisson mean
        assert abs(inside.sum() - want) < 4 * np.sqrt(want), (lo, inside.sum(), want)
        assert lens[inside] == pytest.approx(np.rint(2000 * curve_at(((0, 1), (1000, 4)), a[inside])), abs=1)
    assert len(reqs) == pytest.approx(4000, rel=0.05)


def test_the_same_seed_draws_the_same_requests_under_every_curve():
    flat = generate_requests(_cfg(kind="uniform", isl=4000, fixed_len=None))
    drift = generate_requests(_cfg(kind="uniform", isl=4000, fixed_len=None, rate_curve=((0, 1), (1000, 1))))
    assert [r.prompt_len for r in flat] == [r.prompt_len for r in drift]  # a flat curve: the same workload
    assert [r.arrival_s for r in flat] == pytest.approx([r.arrival_s for r in drift])
    fast = generate_requests(_cfg(kind="uniform", isl=4000, fixed_len=None, rate_curve=((0, 2),)))
    assert [r.prompt_len for r in fast[:len(flat)]] == [r.prompt_len for r in flat]  # twice as many, same order


@pytest.mark.parametrize("kw,match", [
    (dict(rate_curve=((10, 1), (5, 2))), "knot times must increase"),
    (dict(rate_curve=((0, 0),)), "factor > 0"),
    (dict(length_curve=((0, 1, 2),)), r"each knot is \[t_s, factor\]"),
    (dict(rate_curve=((0, 1),), duration_s=None, num_requests=10), "rate_curve needs duration_s"),
])
def test_a_bad_curve_is_refused_saying_why(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_an_experiment_keeps_a_drifting_windows_span_at_a_low_rate():
    from moeflow.experiment.serve import parse_experiment
    raw = {"model": "tiny", "workload": {"kind": "fixed", "fixed_len": 8, "duration_s": 60, "seed": 0,
                                         "rate_curve": [[0, 1], [60, 3]]},
           "systems": {"a": {"mode": "colocated"}}}
    w = parse_experiment(raw).point_workload(0.5, 0)  # ~60 requests: below min_requests, the curve still spans 60 s
    assert (w.duration_s, w.num_requests) == (60, None)
    reqs = generate_requests(w)
    assert reqs[-1].arrival_s < 60 and len(reqs) < 100
    steady = parse_experiment(raw | {"workload": {"kind": "fixed", "fixed_len": 8, "duration_s": 60, "seed": 0}})
    assert steady.point_workload(0.5, 0).num_requests == 100  # a steady one grows to hold them
