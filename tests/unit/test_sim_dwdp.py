"""The simulator's DWDP at the paper's scale: the contention model (DWDP Table 2) against an
enumeration of the random-state model, what each copy plan pays, the merge cost, compute slowed
while pulling against a fine-grained oracle, and DWDP §3/§5.2's figures on GB200 NVL72 with
DeepSeek-R1 (configs/dwdp-gb200.yaml, fewer requests): docs/simulator.md has the full tables."""
from __future__ import annotations

import dataclasses
import itertools
import random
from fractions import Fraction

import pytest

from moeflow.experiment.serve import load_experiment, parse_experiment
from moeflow.measure.workload import WorkloadRequest
from moeflow.sim.contention import ContentionDraws, contention_pmf, expected_slowdown
from moeflow.sim.dwdp import DwdpSystem, crossover, layer_roofline
from moeflow.sim.run import build_cost
from moeflow.sim.shape import AttnShape
from moeflow.sim.sweep import run_sweeps


def _enumerated_pmf(n: int) -> dict[int, Fraction]:
    """The random-state model spelled out: ranks 0 (marked) and 1 (its source); every other rank
    picks one of its n-1 peers, all choices equally likely; C = 1 + those that picked rank 1."""
    others = range(2, n)
    peers = {r: [p for p in range(n) if p != r] for r in others}
    counts: dict[int, int] = {}
    combos = list(itertools.product(*(peers[r] for r in others)))
    for picks in combos:
        c = 1 + sum(p == 1 for p in picks)
        counts[c] = counts.get(c, 0) + 1
    return {c: Fraction(k, len(combos)) for c, k in counts.items()}


@pytest.mark.parametrize("n", [3, 4, 5, 6, 8])
def test_table2_contention_pmf_matches_the_enumerated_model(n):
    pmf, exact = contention_pmf(n), _enumerated_pmf(n)
    assert set(pmf) == set(exact) == set(range(1, n))
    for c, p in exact.items():
        assert pmf[c] == pytest.approx(float(p), rel=1e-12)


def test_table2_by_hand():
    # N = 4: X ~ Binomial(2, 1/3): 4/9, 4/9, 1/9
    assert [round(100 * p, 1) for p in contention_pmf(4).values()] == [44.4, 44.4, 11.1]
    # N = 8: X ~ Binomial(6, 1/7): Pr[C=1] = Pr[C=2] = (6/7)^6, Pr[C=3] = 15 (1/7)^2 (6/7)^4
    p8 = contention_pmf(8)
    assert p8[1] == pytest.approx((6 / 7) ** 6) and p8[2] == pytest.approx(p8[1])
    assert p8[3] == pytest.approx(15 / 49 * (6 / 7) ** 4)
    assert contention_pmf(2) == {1: 1.0}  # one peer: nobody to contend with
    with pytest.raises(ValueError, match="at least 2 ranks"):
        contention_pmf(1)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_copy_plans_slowdown_matches_enumeration(n):
    """naive: one pull in flight at 1/C of the link; sliced: two slices from two sources, their
    levels drawn independently, the inbound link capping their sum: min(1, 1/C1 + 1/C2)."""
    exact = _enumerated_pmf(n)
    naive = sum(c * p for c, p in exact.items())
    sliced = sum(pa * pb * max(Fraction(1), 1 / (Fraction(1, a) + Fraction(1, b)))
                 for (a, pa), (b, pb) in itertools.product(exact.items(), repeat=2))
    assert expected_slowdown(n, "naive") == pytest.approx(float(naive))
    assert expected_slowdown(n, "sliced") == pytest.approx(float(sliced))
    assert 1 <= expected_slowdown(n, "sliced") < expected_slowdown(n, "naive")


def test_sliced_pulls_lose_nothing_below_level_3_as_the_paper_argues():
    from moeflow.sim.contention import _factor

    for a, b in itertools.product((1, 2), repeat=2):
        assert _factor("sliced", (a, b)) == 1  # two contention-2 slices still fill the port
    for a, b in itertools.product((3, 4, 5), repeat=2):
        assert _factor("sliced", (a, b)) > 1  # both at >= 3: slower (the paper's condition)
    assert _factor("sliced", (2, 3)) == pytest.approx(1.2)  # the mixed case the paper leaves out


def test_naive_draws_average_to_the_expected_level():
    d = ContentionDraws(8, seed=3)
    mean = sum(d.draw() for _ in range(20000)) / 20000
    assert mean == pytest.approx(expected_slowdown(8, "naive"), rel=0.02)
    a, b = ContentionDraws(8, 5), ContentionDraws(8, 5)
    assert [a.draw() for _ in range(50)] == [b.draw() for _ in range(50)]  # seeded: repeatable


def _system(model: str, hw: str, over: dict | None = None, **layout) -> DwdpSystem:
    cfg = parse_experiment({"model": model, "hardware": hw, "hardware_overrides": over or {},
                            "workload": {"kind": "fixed", "fixed_len": 1, "num_requests": 1, "rate_rps": 1},
                            "systems": {"d": {"mode": "dwdp", "max_batch_tokens": 65536, **layout,
                                              "engine": {"num_kv_blocks": 4096, "kv_block_size": 256}}}})
    return DwdpSystem(cfg.systems["d"], build_cost(cfg))


def test_the_merge_copies_every_expert_of_a_layer_before_its_experts_run():
    # pulls instantaneous (huge link): a lone batch's time is its compute, plus the merges
    kw = dict(over={"link_bw_Bps": 1e18, "link_latency_s": 0}, dp=2)
    n = 4096
    times = {}
    for merge in (False, True):
        s = _system("qwen3-235b-a22b", "h200", merge=merge, **kw)
        times[merge] = s.run([WorkloadRequest(0.0, n, 1)]).records[0].ttft_s
    m, c = s.model, s.cost
    per_layer = c.device_copy_s(m.num_experts * m.expert_bytes)  # read + write every expert, HBM-bound
    assert per_layer == pytest.approx(c.hw.launch_s + 2 * m.num_experts * m.expert_bytes / (c.hw.mem_bw_Bps * c.hw.mem_eff))
    assert times[True] - times[False] == pytest.approx(m.num_moe_layers * per_layer, rel=1e-9)


@pytest.mark.parametrize("link_bw,pull_bound", [(1e18, False), (2e10, True)])
def test_each_moe_layer_takes_the_longer_of_its_compute_and_its_own_pull(link_bw, pull_bound):
    """DWDP §3: per layer max(compute, prefetch). Pulls go one layer ahead into two slots, so with
    pulls longer than a layer's compute the copy engine never rests and layer k's experts start
    when pull k is in, (k + 1) pulls after the batch; with instant pulls nothing waits."""
    s = _system("qwen3-235b-a22b", "h200", over={"link_bw_Bps": link_bw, "link_latency_s": 0}, dp=2)
    n = 2048
    rec = s.run([WorkloadRequest(0.0, n, 1)]).records[0]
    m, c = s.model, s.cost
    shape = AttnShape.of([(0, n, True)])
    attn, experts = c.attention_s(shape, 1, False), c.experts_s(n * m.top_k, m.num_experts)
    pull, head = s.pull_time_s(0), c.head_s(shape, 1)
    assert s.slowdown == 1.0  # h200: no copy-engine slowdown to fold in
    assert pull == pytest.approx(c.transfer_s(m.num_experts // 2 * m.expert_bytes))  # the peer's half
    dense = m.num_dense_layers * c.attention_s(shape, 1, True)
    if not pull_bound:
        assert pull < attn
        assert rec.ttft_s == pytest.approx(dense + m.num_moe_layers * (attn + experts) + head, rel=1e-9)
    else:
        assert pull > attn + experts and dense < pull
        assert rec.ttft_s == pytest.approx(m.num_moe_layers * pull + experts + head, rel=1e-9)


def _stepped(windows, t, d, f, dt=1e-5):
    """Oracle for ``_compute``: advance in small steps, at 1/f speed inside a pull window."""
    while d > 1e-12:
        slow = any(a <= t < b for a, b in windows)
        step = min(dt, d * (f if slow else 1))
        d -= step / (f if slow else 1)
        t += step
    return t


def test_compute_is_slowed_only_while_the_copy_engine_pulls():
    s = _system("deepseek-r1", "gb200", dp=4)
    f = s.slowdown
    assert f == 1.226  # DWDP Table 7, short overlaps
    rng = random.Random(0)
    for _ in range(20):
        t, windows = 0.0, []
        for _ in range(3):
            t += rng.uniform(0, 0.01)
            windows.append((t, t + rng.uniform(0.001, 0.01)))
            t = windows[-1][1]
        start, d = rng.uniform(0, 0.02), rng.uniform(0.001, 0.02)
        s.windows[0] = list(windows)
        assert s._compute(0, start, d) == pytest.approx(_stepped(windows, start, d, f), abs=2e-5)


def test_roofline_crossover_at_batch_1():
    """DWDP §3 (Fig. 3): the pull hides behind compute near 16K tokens. Simulated: 12.7K, 20% early
    (a miss of the ±15% target, explained in docs/simulator.md: the context attention priced at the
    bf16 peak)."""
    cfg = load_experiment("configs/dwdp-gb200.yaml")
    cost = build_cost(cfg)
    pts = [layer_roofline(cost, 4, isl) for isl in cfg.roofline_isl]
    hidden = crossover(pts, "hidden")
    assert 8192 < hidden <= 16384 and hidden == pytest.approx(12738, rel=0.01)
    assert crossover(pts, "speedup") < hidden  # DEP pays its all-to-all too: DWDP leads a little earlier
    assert pts[-1].speedup < max(p.speedup for p in pts)  # the gain fades at long ISL (§3)
    # the same layer in the systems: a lone request's attention block is what the roofline prices
    m = cost.model
    assert pts[0].compute_s == pytest.approx(cost.attention_s(AttnShape.of([(0, 1024, True)]), 1, False)
                                             + cost.experts_s(1024 * m.top_k, m.num_experts))


# DEP4's compute jitter and expert skew off: the paper's tables are checked against the model without
# them (with them DEP4 loses more: test_barrier_losses_widen_dwdps_lead)
NO_BARRIER_NOISE = ("sim.compute_jitter_cv=0", "sim.expert_load_cv=0")


def _sweep(field: str, sets: tuple[str, ...] = NO_BARRIER_NOISE) -> list[dict]:
    cfg = load_experiment("configs/dwdp-gb200.yaml", sets)
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, num_requests=768),
                              sweeps=tuple((f, v[1::2] if f == "isl" else v[::4], w) for f, v, w in cfg.sweeps if f == field),
                              compare=(("dwdp4", "dep4_dedup"), ("dwdp4", "dep4")))
    return run_sweeps(cfg, build_cost(cfg), ["dep4", "dep4_dedup", "dwdp4"])[field]


def test_table3a_speedup_over_isl_within_20pct():
    """Paper: 1.09-1.11x TPS/GPU over DEP4 for ISL 1K-32K (MNT 32768)."""
    rows = _sweep("isl")
    for r in rows:
        assert 0.8 * 1.09 <= r["ratios"]["dwdp4/dep4_dedup"] <= 1.2 * 1.11, r
        # against moeflow's own dep (a row per (token, expert) pair) the gain is larger
        assert r["ratios"]["dwdp4/dep4"] > r["ratios"]["dwdp4/dep4_dedup"]


def test_barrier_losses_widen_dwdps_lead():
    """DWDP has no barrier; DEP4 waits at every layer for its slowest rank (jitter) and its most
    loaded expert device (skew): with the cited defaults its gain at ISL 2K is larger."""
    quiet = _sweep("isl")[0]["ratios"]["dwdp4/dep4_dedup"]
    noisy = _sweep("isl", ())[0]["ratios"]["dwdp4/dep4_dedup"]
    assert noisy > quiet * 1.05, (quiet, noisy)


def test_table3c_speedup_rises_with_the_length_spread():
    """Paper: 1.08x -> 1.15x as the standard deviation of the input length grows."""
    even, spread = _sweep("isl_std")
    assert (even["value"], spread["value"]) == (0, 4096)
    lo, hi = even["ratios"]["dwdp4/dep4_dedup"], spread["ratios"]["dwdp4/dep4_dedup"]
    assert 0.8 * 1.08 <= lo <= 1.2 * 1.08 and 0.8 * 1.15 <= hi <= 1.2 * 1.15 and hi > lo + 0.05
