"""The simulator's elastic pd: the engine's xPyD controller on simulated windows. Oracle: a policy that
may not move is the fixed deployment, request for request; a change is carried out as the engine does
it (a joiner serves once started and loaded, a leaver takes nothing new and goes once what it holds is
done) and every instance is paid from its start to its exit."""
from __future__ import annotations

import pytest

from moeflow.measure.workload import generate_requests
from moeflow.scheduler.autoscale_pd import PdDecision
from moeflow.sim.elastic_pd import ElasticPdSystem
from moeflow.sim.run import build_cost, make_system

from test_sim_elastic import _cfg, assert_still_is_fixed  # elastic afd's model, hardware and workload

SIDE = {"mode": "dep", "dp": 2, "max_batch_tokens": 8192}
PD = {"mode": "pd", "prefill": SIDE, "decode": SIDE, "prefill_instances": 2, "decode_instances": 2,
      "engine": {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024}}
STILL = {"tpot_slo_s": 0.05, "ttft_slo_s": 2.0, "min_prefill": 2, "max_prefill": 2, "min_decode": 2, "max_decode": 2,
         "sample_s": 1.0, "interval_s": 0.0, "window": 1}


def test_a_controller_that_may_not_move_is_the_fixed_deployment_request_for_request():
    eres = assert_still_is_fixed(PD, STILL, 8)
    assert eres.windows and all(w["prefill_busy"] > 0 for w in eres.windows[1:5])  # it saw the prefill side work


def _scripted(decisions: dict[float, tuple[int, int]]):
    cfg = _cfg(elastic={**PD, "autoscale": {**STILL, "min_prefill": 1, "max_prefill": 3, "min_decode": 1,
                                            "max_decode": 3}})
    sim = make_system(cfg.systems["elastic"], build_cost(cfg))
    assert isinstance(sim, ElasticPdSystem)

    def observe(s):
        d = decisions.get(s.t_s)
        return None if d is None else PdDecision(s.t_s, *d, "scripted", 0.0)

    sim.controller.observe = observe
    return cfg, sim


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_instance_joins_once_started_and_loaded_and_is_paid_from_the_decision(side):
    cfg, sim = _scripted({3.0: (3, 2) if side == "prefill" else (2, 3)})
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    (c,) = res.changes
    m = sim.model
    load = sim.link_cost(side, side).transfer_s((m.attention_side_bytes + m.expert_bytes * m.num_experts
                                                 * m.num_moe_layers) / 2)
    assert (c["side"], c["before"], c["after"], c["asked_s"]) == (side, 2, 3, 3.0)
    assert c["done_s"] == pytest.approx(3.0 + sim.spec.sim.member_start_s + load)
    assert len(getattr(sim, side)) == 3 and getattr(sim.layout, f"{side}_instances") == 3
    # 2 processes per instance: 4 instances all along, a fifth from the decision
    assert res.process_s == pytest.approx(2 * (4 * res.end_s + (res.end_s - 3.0)))
    assert not sim.requests  # every request answered
    assert all(not (3.0 < w["t_s"] < c["done_s"]) for w in res.windows)  # none under the change


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_leaving_instance_takes_nothing_from_the_decision_and_goes_once_it_holds_nothing(side):
    cfg, sim = _scripted({5.0: (1, 2) if side == "prefill" else (2, 1)})
    placed: dict[str, tuple[int, float]] = {}  # request -> (instance of the side, when)
    if side == "prefill":
        for i, s in enumerate(sim.prefill):
            s.add = (lambda add, i: lambda r: (placed.setdefault(r.request_id, (i, sim.loop.now)), add(r)))(s.add, i)
    else:
        start = sim.machine.start

        def spy(h, now):
            ok = start(h, now)
            if ok:
                placed[h.request_id] = (h.decode, now)
            return ok
        sim.machine.start = spy
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    (c,) = res.changes
    assert (c["side"], c["before"], c["after"]) == (side, 2, 1) and c["done_s"] >= 5.0
    assert len(getattr(sim, side)) == 1 and len(getattr(sim.machine, side)) == 1
    assert all(i == 0 for i, t in placed.values() if t > 5.0)  # nothing placed on the leaver after the decision
    assert any(i == 1 for i, t in placed.values() if t <= 5.0)  # it held some before
    assert not sim.requests  # every request answered
    assert res.process_s == pytest.approx(2 * (3 * res.end_s + c["done_s"]))


@pytest.mark.parametrize("path,fixed", [("configs/elastic-afd-here.yaml", "afd_1a1f"),
                                        ("configs/elastic-pd-here.yaml", "pd_1p1d")])
def test_an_elastic_deployment_that_may_outgrow_the_cores_shares_them_from_its_start(path, fixed):
    """Two processes on two cores need no calendar; an elastic one that may grow to four does, from the
    start (its joiners compute on the same cores)."""
    from moeflow.experiment.serve import load_experiment

    cfg = load_experiment(path)
    cost = build_cost(cfg)
    assert make_system(cfg.systems[fixed], cost).cores is None
    sim = make_system(cfg.systems["elastic"], cost)
    assert sim.cores is not None and sim.cores.cores == 2
    assert all(s.cores is sim.cores for s in getattr(sim, "prefill", []) + getattr(sim, "decode", []))


def test_a_run_that_runs_out_of_events_with_requests_unfinished_says_so():
    cfg = _cfg(fixed=PD)
    sim = make_system(cfg.systems["fixed"], build_cost(cfg))
    for d in sim.decode:  # decode instances that never schedule: every handoff lands and waits
        d.sched.schedule = lambda now: []
    with pytest.raises(RuntimeError, match=r"ran out of events at .* with \d+ requests unfinished"):
        sim.run(generate_requests(cfg.point_workload(4.0, 1)))
