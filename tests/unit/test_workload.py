"""Workload generation: seeded, rates and burstiness as requested, the production fit, traces."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from moeflow.measure import production_lengths as pl
from moeflow.measure import workload as wl
from moeflow.measure.workload import WorkloadConfig, generate_requests


def _gaps(reqs) -> np.ndarray:
    return np.diff([0.0] + [r.arrival_s for r in reqs])


def test_same_seed_same_requests_other_seed_differs():
    cfg = WorkloadConfig(kind="production", rate_rps=3.0, duration_s=50.0, seed=7)
    assert generate_requests(cfg) == generate_requests(cfg)
    other = generate_requests(WorkloadConfig(kind="production", rate_rps=3.0, duration_s=50.0, seed=8))
    assert other != generate_requests(cfg)


def test_lengths_do_not_depend_on_the_rate():
    # common random numbers: comparing rates compares the same prompts
    a = generate_requests(WorkloadConfig(kind="production", rate_rps=1.0, num_requests=200, seed=3))
    b = generate_requests(WorkloadConfig(kind="production", rate_rps=9.0, num_requests=200, seed=3))
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_rate_matches_the_request_within_tolerance(burstiness):
    reqs = generate_requests(WorkloadConfig(kind="fixed", fixed_len=8, rate_rps=4.0, num_requests=20000,
                                            burstiness=burstiness, seed=1))
    assert len(reqs) == 20000
    # mean gap 0.25 s; its standard error is 0.25 * CV / sqrt(n) <= 0.0025 s: 3% is > 3 sigma
    assert _gaps(reqs).mean() == pytest.approx(0.25, rel=0.03)
    by_time = generate_requests(WorkloadConfig(kind="fixed", fixed_len=8, rate_rps=5.0, duration_s=1000.0,
                                               burstiness=burstiness, seed=2))
    assert len(by_time) == pytest.approx(5000, rel=0.05)  # sd of the count ~ sqrt(5000 / burstiness) = 100
    assert all(0 < r.arrival_s < 1000.0 for r in by_time)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(by_time, by_time[1:]))


def test_burstiness_sets_the_cv_of_the_gaps():
    def cv(b: float) -> float:
        g = _gaps(generate_requests(WorkloadConfig(kind="fixed", fixed_len=8, rate_rps=2.0, num_requests=20000,
                                                   burstiness=b, seed=4)))
        return g.std() / g.mean()

    # gamma gaps with shape k: CV = 1 / sqrt(k); Poisson (k = 1) has CV 1
    assert cv(1.0) == pytest.approx(1.0, rel=0.05)
    assert cv(0.25) == pytest.approx(2.0, rel=0.08)
    assert cv(4.0) == pytest.approx(0.5, rel=0.05)


def test_production_mean_and_bounds():
    lens = np.array([r.prompt_len for r in generate_requests(
        WorkloadConfig(kind="production", rate_rps=1.0, num_requests=20000, seed=0))])
    # sd ~5.4k, so the standard error of the mean is ~40 tokens: 3% of 5000 is > 3 sigma
    assert lens.mean() == pytest.approx(pl.PRODUCTION_MEAN_LEN, rel=0.03)
    assert lens.min() >= pl.PRODUCTION_MIN_LEN and lens.max() <= pl.PRODUCTION_MAX_LEN
    assert np.median(lens) < 0.7 * lens.mean()  # heavy right tail
    assert (lens > 16384).mean() > 0.02  # long prompts do occur


def test_the_fitted_constants_are_what_the_fit_gives():
    mu, sigma = pl.fit_production_lognormal()
    assert mu == pytest.approx(pl.PRODUCTION_LOG_MU, abs=1e-5)
    assert sigma == pytest.approx(pl.PRODUCTION_LOG_SIGMA, abs=1e-5)
    mean = pl.restricted_lognormal_mean(mu, sigma, pl.PRODUCTION_MIN_LEN, pl.PRODUCTION_MAX_LEN)
    assert mean == pytest.approx(pl.PRODUCTION_MEAN_LEN, rel=1e-4)


def test_restricted_mean_formula_matches_sampling():
    rng = np.random.default_rng(0)
    x = rng.lognormal(6.0, 1.5, 400_000)
    x = x[(x >= 50) & (x <= 5000)]
    assert pl.restricted_lognormal_mean(6.0, 1.5, 50, 5000) == pytest.approx(x.mean(), rel=0.01)


def test_length_scale_applies_after_the_cap_with_a_one_token_floor():
    base = generate_requests(WorkloadConfig(kind="production", rate_rps=1.0, num_requests=3000, seed=5))
    small = generate_requests(WorkloadConfig(kind="production", rate_rps=1.0, num_requests=3000, seed=5,
                                             length_scale=0.01))
    assert [s.prompt_len for s in small] == [max(1, round(b.prompt_len * 0.01)) for b in base]
    assert max(s.prompt_len for s in small) <= round(pl.PRODUCTION_MAX_LEN * 0.01)
    assert min(s.prompt_len for s in small) >= 1


def test_uniform_and_fixed_lengths():
    reqs = generate_requests(WorkloadConfig(kind="uniform", isl=1000, isl_ratio=0.8, rate_rps=1.0,
                                            num_requests=5000, output_len=3))
    lens = [r.prompt_len for r in reqs]
    assert min(lens) == 800 and max(lens) == 1000
    assert all(r.output_len == 3 for r in reqs)
    assert {r.prompt_len for r in generate_requests(WorkloadConfig(kind="fixed", fixed_len=77, rate_rps=1.0,
                                                                   num_requests=10))} == {77}


@pytest.mark.parametrize("kwargs, msg", [
    (dict(kind="zipf", rate_rps=1.0, duration_s=1.0), "kind must be one of"),
    (dict(kind="fixed", fixed_len=4, duration_s=1.0), "needs rate_rps"),
    (dict(kind="fixed", fixed_len=4, rate_rps=0.0, duration_s=1.0), "rate_rps must be > 0"),
    (dict(kind="fixed", fixed_len=4, rate_rps=1.0), "duration_s or num_requests"),
    (dict(kind="fixed", rate_rps=1.0, duration_s=1.0), "fixed_len"),
    (dict(kind="uniform", isl=10, isl_ratio=1.5, rate_rps=1.0, duration_s=1.0), "isl_ratio"),
    (dict(kind="uniform", rate_rps=1.0, duration_s=1.0), "isl"),
    (dict(kind="production", rate_rps=1.0, duration_s=1.0, burstiness=0.0), "burstiness"),
    (dict(kind="production", rate_rps=1.0, duration_s=1.0, length_scale=-1.0), "length_scale"),
    (dict(kind="production", rate_rps=1.0, duration_s=1.0, output_len=0), "output_len"),
    (dict(kind="trace"), "trace_path"),
])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        WorkloadConfig(**kwargs)


def _write(tmp_path, lines: list[str]) -> str:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_trace_is_read_sorted_with_default_output_len(tmp_path):
    path = _write(tmp_path, [json.dumps({"arrival_s": 2.0, "prompt_len": 30}),
                             "",
                             json.dumps({"arrival_s": 0.5, "prompt_len": 10, "output_len": 4}),
                             json.dumps({"arrival_s": 1, "prompt_len": 20})])
    reqs = generate_requests(WorkloadConfig(kind="trace", trace_path=path, output_len=2))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0.5, 10, 4), (1.0, 20, 2), (2.0, 30, 2)]
    scaled = generate_requests(WorkloadConfig(kind="trace", trace_path=path, length_scale=0.5, duration_s=1.5))
    assert [r.prompt_len for r in scaled] == [5, 10]
    # rescaled to 4 rps: 2 gaps over 1.5 s recorded become 0.5 s
    fast = generate_requests(WorkloadConfig(kind="trace", trace_path=path, rate_rps=4.0))
    assert [r.arrival_s for r in fast] == pytest.approx([0.5, 0.5 + 0.5 / 3, 1.0])


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"prompt_len": 3}', "missing 'arrival_s'"),
    ('{"arrival_s": 1.0}', "missing 'prompt_len'"),
    ('{"arrival_s": -1, "prompt_len": 3}', "arrival_s must be"),
    ('{"arrival_s": "1", "prompt_len": 3}', "arrival_s must be"),
    ('{"arrival_s": 1, "prompt_len": 0}', "prompt_len must be"),
    ('{"arrival_s": 1, "prompt_len": 2.5}', "prompt_len must be"),
    ('{"arrival_s": 1, "prompt_len": 3, "output_len": true}', "output_len must be"),
    ('{"arrival_s": 1, "prompt_len": 3, "prompt": "x"}', "unknown field"),
])
def test_trace_errors_name_the_line(tmp_path, line, msg):
    path = _write(tmp_path, ['{"arrival_s": 0, "prompt_len": 3}', line])
    with pytest.raises(ValueError, match=msg) as e:
        wl.read_trace(path)
    assert f"{path}:2:" in str(e.value)


def test_empty_trace_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        wl.read_trace(_write(tmp_path, [""]))


def test_the_measurement_library_does_not_import_torch():
    # the simulator imports every module of measure/ and experiment/ and must stay torch-free; a
    # result's provenance, written without torch loaded, must not load it either
    code = ("import importlib, pkgutil, sys, moeflow.measure, moeflow.experiment\n"
            "for pkg in (moeflow.measure, moeflow.experiment):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
            "from moeflow.measure.provenance import provenance\n"
            "provenance()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_raw_mean_fit():
    """§2.3's 5k is the whole trace's mean: fitted before §5.1's 32k cut, the kept mean is ~4.2k."""
    mu, sigma = pl.fit_production_lognormal("raw")
    assert (mu, sigma) == pytest.approx((pl.PRODUCTION_RAW_LOG_MU, pl.PRODUCTION_RAW_LOG_SIGMA), abs=1e-5)
    assert pl.restricted_lognormal_mean(mu, sigma, pl.PRODUCTION_MIN_LEN, math.inf) == pytest.approx(5000, rel=1e-4)
    kept = pl.restricted_lognormal_mean(mu, sigma, pl.PRODUCTION_MIN_LEN, pl.PRODUCTION_MAX_LEN)
    assert kept == pytest.approx(4221, abs=1)
    lens = np.array([r.prompt_len for r in generate_requests(WorkloadConfig(
        kind="production", rate_rps=1.0, num_requests=20000, seed=0, production_mean="raw"))])
    assert lens.mean() == pytest.approx(kept, rel=0.03) and lens.max() <= pl.PRODUCTION_MAX_LEN
    assert WorkloadConfig(kind="production", rate_rps=1.0, num_requests=1).production_mean == "kept"
    with pytest.raises(ValueError, match="production_mean"):
        WorkloadConfig(kind="production", rate_rps=1.0, num_requests=1, production_mean="median")


def test_request_rates_parse_as_bench_serve_reads_them():
    assert wl.parse_rates("0.5, 1,2", "production") == [0.5, 1.0, 2.0]
    assert wl.parse_rates(None, "production") == [1.0] and wl.parse_rates(None, "trace") == [None]
    for bad in ("fast", "0", "-1", "inf", ","):
        with pytest.raises(ValueError, match="--request-rate"):
            wl.parse_rates(bad, "production")


def test_output_lengths_in_a_range_leave_arrivals_and_prompts_alone():
    from moeflow.measure.workload import WorkloadConfig, generate_requests

    base = dict(rate_rps=2.0, duration_s=30, length_scale=0.1, seed=5)
    fixed = generate_requests(WorkloadConfig(**base, output_len=32))
    ranged = generate_requests(WorkloadConfig(**base, output_len=32, output_len_max=128))
    assert [(r.arrival_s, r.prompt_len) for r in ranged] == [(r.arrival_s, r.prompt_len) for r in fixed]
    outs = [r.output_len for r in ranged]
    assert min(outs) >= 32 and max(outs) <= 128 and len(set(outs)) > 10
    assert outs == [r.output_len for r in generate_requests(WorkloadConfig(**base, output_len=32, output_len_max=128))]
    with pytest.raises(ValueError, match="output_len_max must be >= output_len"):
        WorkloadConfig(**base, output_len=32, output_len_max=16)
