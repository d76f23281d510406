"""The simulator's prefill/decode-disaggregated deployments (sim/pd.py): instances of any simulated
mode on one clock, the KV handoff priced from the model's bytes, decode room before the copy."""
from __future__ import annotations

import pytest

from moeflow.experiment.serve import parse_experiment
from moeflow.measure.workload import WorkloadRequest
from moeflow.sim.run import build_cost, make_system, run_point

_BASE = {"model": "tiny", "hardware": "h200", "rps": [1],
         "workload": {"kind": "fixed", "fixed_len": 256, "output_len": 16, "duration_s": 4, "seed": 0}}
_QUIET = {"compute_jitter_cv": 0, "expert_load_cv": 0}  # closed forms below: no jitter, no skew


def _cfg(systems: dict):
    return parse_experiment({**_BASE, "systems": {k: {**v, "sim": _QUIET} for k, v in systems.items()}})


def _run(cfg, name: str, workload: list[WorkloadRequest]):
    sim = make_system(cfg.systems[name], build_cost(cfg))
    return sim, sim.run(workload)


def test_a_lone_request_prefills_hands_off_then_decodes():
    """TTFT is the prefill instance's (the same as the same layout's alone); the handoff is the
    prompt's KV over the link; the decode side produces every other token."""
    cfg = _cfg({"pd": {"mode": "pd", "prefill": {"mode": "dep", "dp": 1}, "decode": {"mode": "dep", "dp": 1}},
                "dep": {"mode": "dep", "dp": 1}})
    one = [WorkloadRequest(0.0, 256, 16)]
    sim, pd = _run(cfg, "pd", one)
    _, alone = _run(cfg, "dep", one)
    (r,), (a,) = pd.records, alone.records
    assert r.num_output == a.num_output == 16 and r.first_token_s == pytest.approx(a.first_token_s)
    cost, m = build_cost(cfg), sim.model
    assert r.handoff_s == pytest.approx(cost.transfer_s(256 * m.kv_bytes_per_token_layer * m.num_layers))
    # 15 decode steps after the KV landed, each as long as the aggregated system's
    assert r.finished_s - r.first_token_s - r.handoff_s == pytest.approx(a.finished_s - a.first_token_s, rel=1e-6)
    # the run ends with its last request (the lease's timer does not stretch it): 15 of 16 steps decode
    assert pd.end_s == r.finished_s and 0 < pd.busy["prefill.rank"] < 0.2 < 0.6 < pd.busy["decode.rank"] < 1


def test_handoffs_wait_for_decode_room_and_all_finish():
    """Instances with room for two requests' KV: the others wait prefilled (their prefill blocks
    leased) and land as earlier ones finish; nobody is lost, no block is left behind."""
    cfg = _cfg({"pd": {"mode": "pd", "engine": {"num_kv_blocks": 36}, "prefill": {"mode": "dep", "dp": 1},
                       "decode": {"mode": "dep", "dp": 1}}})
    work = [WorkloadRequest(0.001 * i, 256, 16) for i in range(6)]
    sim, res = _run(cfg, "pd", work)
    assert len(res.records) == 6 and not sim.waiting and not sim.requests
    recs = sorted(res.records, key=lambda r: r.arrival_s)
    e2e = [r.finished_s - r.arrival_s for r in recs]
    assert e2e[-1] > 2 * e2e[0]  # the last waited for room the first ones freed
    # in place, a prefilled request's blocks stay leased until the decode side has read them: the
    # prefill instance (room for two) makes the fifth wait for its first token too
    assert recs[4].first_token_s - recs[4].arrival_s > 2 * (recs[0].first_token_s - recs[0].arrival_s)
    assert sim.prefill[0].sched.pool.leases == {} and sim.decode[0].sched.pool.groups[0].allocator.num_free == 36


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_lease_that_runs_out_fails_or_recomputes(policy):
    cfg = _cfg({"pd": {"mode": "pd", "kv_lease_s": 0.001, "kv_load_failure_policy": policy,
                       "engine": {"num_kv_blocks": 18}, "prefill": {"mode": "dep", "dp": 1},
                       "decode": {"mode": "dep", "dp": 1}}})
    work = [WorkloadRequest(0.0, 256, 16), WorkloadRequest(0.0, 256, 16)]
    sim, res = _run(cfg, "pd", work)
    assert sim.lease_expiries == 1 and sim.prefill[0].sched.pool.leases == {}
    if policy == "fail":
        assert len(res.records) == 1 and res.num_failed == 1  # counted, not lost
    else:
        assert len(res.records) == 2 and all(r.num_output == 16 for r in res.records)


def test_every_prefill_mode_into_every_decode_mode_reports_tpot():
    systems = {f"{p}_{d}": {"mode": "pd", "prefill": pl, "decode": dl}
               for p, pl in (("asap", {"mode": "asap", "attn_dp": 1, "moe_workers": 2}),
                             ("dwdp", {"mode": "dwdp", "dp": 2}), ("dep", {"mode": "dep", "dp": 2}))
               for d, dl in (("afd", {"mode": "afd", "attn_workers": 1, "ffn_workers": 1, "micro_batches": 2}),
                             ("dep", {"mode": "dep", "dp": 2}))}
    cfg = _cfg(systems)
    cost = build_cost(cfg)
    for name, spec in cfg.systems.items():
        point, _ = run_point(spec, cost, cfg, 2.0)
        assert point["completed"] == point["num_requests"] > 0, name
        assert point["tpot_mean_s"] > 0 and point["handoff_mean_s"] > 0 and point["tps_user_mean"] > 0, name
        assert point["output_tok_s_per_process"] * spec.layout.num_processes == pytest.approx(point["output_tok_s"])
