"""Rate matching of prefill and decode instances against its brute-force oracle, the Pareto helpers,
and the end-to-end (``e2e:``) experiment file on a small analytic case."""
from __future__ import annotations

import random

import pytest
import yaml

from moeflow.config import ConfigError
from moeflow.sim.rate_match import Side, brute_force, front_at, front_ratio, pareto_front, rate_match


def test_rate_match_agrees_with_brute_force_on_random_cases():
    rng = random.Random(0)
    for _ in range(2000):
        p = Side("p", rng.choice([1, 2, 3, 4, 8]), rng.uniform(0.1, 20))
        d = Side("d", rng.choice([1, 2, 4, 8, 16]), rng.uniform(0.1, 20))
        n, u, bound = rng.randint(2, 40), rng.choice([1.0, 0.9, 0.5]), rng.random() < 0.5
        fast, slow = rate_match(p, d, n, u, bound), brute_force(p, d, n, u, bound)
        assert fast == slow, (p, d, n, u, bound, fast, slow)
        if fast is not None:
            assert fast.devices <= n and fast.rps <= fast.prefill_instances * p.rps * u * (1 + 1e-9)
            assert fast.rps <= fast.decode_instances * d.rps * (1 + 1e-9)
            assert not bound or fast.rps == pytest.approx(fast.decode_instances * d.rps)


def test_rate_match_by_hand():
    # a prefill instance (2 devices) takes 3 req/s, a decode instance (1 device) completes 2: two of
    # each serve 4 req/s on 6 devices (0.67 per device), two prefill and three decode 6 on 7 (0.86)
    s = rate_match(Side("p", 2, 3.0), Side("d", 1, 2.0), 7)
    assert (s.prefill_instances, s.decode_instances, s.devices) == (2, 3, 7) and s.rps == 6.0
    assert s.prefill_utilization == 1.0
    # held to 90%, two prefill instances take 5.4 of the three decode instances' 6: still the best
    s = rate_match(Side("p", 2, 3.0), Side("d", 1, 2.0), 7, max_utilization=0.9)
    assert (s.prefill_instances, s.decode_instances) == (2, 3) and s.rps == pytest.approx(5.4)
    # a prefill side slower than one decode instance: one of each, at the prefill side's rate
    s = rate_match(Side("p", 2, 1.0), Side("d", 2, 5.0), 4)
    assert (s.prefill_instances, s.decode_instances, s.rps) == (1, 1, 1.0) and s.prefill_utilization == 1.0
    assert rate_match(Side("p", 4, 1.0), Side("d", 4, 1.0), 7) is None  # one of each needs 8


def test_processes_sharing_cores_are_priced_by_their_share():
    """On a 2-core host each side measured alone on its own core: four processes run at half speed,
    so two of each serve what one of each does, and the rate is per core, not per process."""
    p, d = Side("p", 1, 2.0), Side("d", 1, 2.0)
    one = brute_force(p, d, 2, cores=2)
    assert (one.prefill_instances, one.decode_instances, one.rps, one.rps_per_device) == (1, 1, 2.0, 1.0)
    s = rate_match(p, d, 4, cores=2)
    assert s == one  # (2, 2) ties at 1 per core and is the larger
    two = brute_force(p, d, 4, cores=2)
    assert two == one and _split_rate(p, d, 2, 2, 2) == pytest.approx(2.0)


def _split_rate(p, d, x, y, cores):
    from moeflow.sim.rate_match import _split

    return _split(p, d, x, y, 1.0, cores).rps


def test_side_and_utilization_are_checked():
    with pytest.raises(ValueError, match="rps > 0"):
        Side("p", 1, 0.0)
    with pytest.raises(ValueError, match="max_utilization"):
        rate_match(Side("p", 1, 1.0), Side("d", 1, 1.0), 4, max_utilization=1.5)


def test_pareto_front_and_ratios():
    pts = [(10, 100), (20, 80), (15, 70), (30, 50), (5, 90), (30, 40)]
    front = pareto_front(pts)
    assert front == [(10, 100), (20, 80), (30, 50)]
    assert front_at(front, 5) == 100 and front_at(front, 15) == 90 and front_at(front, 31) is None
    doubled = [(x, 2 * y) for x, y in front]
    r = front_ratio(doubled, front, 10, 30)
    assert r["mean"] == pytest.approx(2.0) and r["read_at"] == [10, 30, 41]
    assert front_ratio(doubled, front, 40, 50)["mean"] is None


E2E = """
model: tiny
hardware: h200
workload: {kind: uniform, isl: 512, isl_ratio: 0.5, output_len: 64, num_requests: 64, seed: 0}
systems:
  dep2: {mode: dep, dp: 2, engine: {num_kv_blocks: 4096}}
  dwdp2: {mode: dwdp, dp: 2, engine: {num_kv_blocks: 4096}}
e2e:
  baseline: dep2
  devices: 8
  decode:
    gen_dep2: {mode: dep, dp: 2, engine: {memory_budget_gib: 4}}
  decode_batches: [1, 4, 16]
  range_tps_user: [1, 100000]
  band_tps_user: [1, 100000]
  ttft_requests: 16
"""


def test_the_e2e_file_runs_and_every_point_is_rate_matched():
    from moeflow.experiment.e2e import parse_e2e
    from moeflow.sim.e2e import format_e2e, run_e2e
    from moeflow.sim.run import build_cost

    x = parse_e2e(yaml.safe_load(E2E))
    r = run_e2e(x, build_cost(x.experiment))
    assert set(r["context"]) == {"dep2", "dwdp2"} and len(r["generation"]) == 3
    for name, ps in r["points"].items():
        assert ps and all(p["devices"] <= 8 and p["prefill_utilization"] <= 0.9 + 1e-9 for p in ps)
        assert all(p["rps"] <= g["rps"] * p["generation_instances"] * (1 + 1e-9) for p in ps
                   for g in r["generation"] if g["batch_per_group"] == p["batch_per_group"])
        for p in ps:  # the split is the oracle's for that point's two sides
            g = next(g for g in r["generation"] if g["batch_per_group"] == p["batch_per_group"])
            oracle = brute_force(Side("p", 2, r["context"][name]["rps"]), Side("d", 2, g["rps"]), 8, 0.9, True)
            assert (p["context_instances"], p["generation_instances"]) == (oracle.prefill_instances,
                                                                           oracle.decode_instances)
        assert any(p.get("ttft_p50_s") for p in ps if p["on_front"])
    assert "dwdp2 / dep2" in format_e2e(x, r)


@pytest.mark.parametrize("edit,match", [
    ({"baseline": "nope"}, "baseline 'nope'"),
    ({"decode": {"g": {"mode": "dwdp", "dp": 2, "engine": {"memory_budget_gib": 4}}}}, "dep or afd"),
    ({"decode": {"g": {"mode": "dep", "dp": 2}}}, "memory_budget_gib"),
    ({"band_tps_user": [30, 20]}, "band_tps_user"),
    ({"paper": {"speedup": 2}}, "unknown ratios"),
    ({"devices": 1}, "devices"),
])
def test_the_e2e_file_is_validated(edit, match):
    from moeflow.experiment.e2e import parse_e2e

    d = yaml.safe_load(E2E)
    d["e2e"].update(edit)
    with pytest.raises(ConfigError, match=match):
        parse_e2e(d)


def test_simulate_runs_an_e2e_file_and_writes_its_fronts(tmp_path, capsys):
    import json

    from moeflow.cli import main

    cfg = tmp_path / "e2e.yaml"
    cfg.write_text(E2E)
    out = tmp_path / "e2e.json"
    assert main(["simulate", "--config", str(cfg), "--json", str(out), "--plot", str(tmp_path / "f.png")]) == 0
    d = json.loads(out.read_text())
    assert set(d["fronts"]) == {"dep2", "dwdp2"} and d["ratios"]["dwdp2"]["tps_per_device_band"]["mean"] > 0
    assert (tmp_path / "f.png").stat().st_size > 0
    assert main(["simulate", "--config", str(cfg), "--request-rate", "1"]) != 0
    assert "--request-rate: not for an end-to-end file" in capsys.readouterr().err
