"""The simulator's elastic dep: the engine's controller of ranks on simulated windows. Oracle: a policy
that may not move is the fixed deployment, request for request; a change is carried out as the engine
does it (a joiner serves once started and its slots copied, a leaver admits nothing new and goes once it
holds nothing), the placement is ``resize``'s, and every rank is paid from its start to its exit."""
from __future__ import annotations

import pytest

from moeflow.measure.workload import generate_requests
from moeflow.scheduler.autoscale_ep import EpDecision
from moeflow.scheduler.eplb import resize
from moeflow.sim.elastic_dep import ElasticDepSystem
from moeflow.sim.run import build_cost, make_system

from test_sim_elastic import _cfg, assert_still_is_fixed  # elastic afd's model, hardware and workload

DEP = {"mode": "dep", "dp": 4, "max_dp": 6, "max_batch_tokens": 8192,
       "engine": {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024},
       "sim": {"expert_load_cv": 0.5}}
STILL = {"tpot_slo_s": 0.05, "ttft_slo_s": 2.0, "min_ranks": 4, "max_ranks": 4, "sample_s": 1.0, "interval_s": 0.0,
         "window": 1}


def test_a_controller_that_may_not_move_is_the_fixed_deployment_request_for_request():
    eres = assert_still_is_fixed(DEP, STILL, 4)
    w = eres.windows[3]
    assert w["batch"] > 0 and w["imbalance"][1] > 1.0  # it saw the ranks decode, and the skewed experts
    assert w["imbalance"][0] != w["imbalance"][0]  # nan: three ranks cannot hold the four's slots


def _scripted(decisions: dict[float, int]):
    cfg = _cfg(elastic={**DEP, "autoscale": {**STILL, "max_ranks": 6}})
    sim = make_system(cfg.systems["elastic"], build_cost(cfg))
    assert isinstance(sim, ElasticDepSystem)

    def observe(s):
        d = decisions.get(s.t_s)
        return None if d is None else EpDecision(s.t_s, d, "scripted", 0.0)

    sim.controller.observe = observe
    return cfg, sim


def test_ranks_join_once_their_slots_are_copied_take_the_resized_placement_and_are_paid_from_the_decision():
    cfg, sim = _scripted({3.0: 6})
    start = sim.placement
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    (c,) = res.changes
    m = sim.model
    copy = sim.link_cost("rank", "rank").transfer_s(start.slots_per_device[-1] * m.expert_bytes * m.num_moe_layers)
    assert (c["before"], c["after"], c["asked_s"]) == (4, 6, 3.0)
    ready = 3.0 + sim.spec.sim.member_start_s + copy
    assert ready <= c["done_s"] < ready + 0.1  # at the first global step boundary after they are ready
    assert sim.layout.dp == 6 and len(sim.sched.pool.groups) == 6 and sim.ep == 6
    assert sim.placement == resize(start, 6, sim.pop.tolist())
    assert sim.local == max(sim.placement.slots_per_device)  # the joiners' slots: replicas, all read
    assert res.process_s == pytest.approx(4 * res.end_s + 2 * (res.end_s - 3.0))
    assert not sim.track  # every request answered
    assert all(not (3.0 < w["t_s"] < c["done_s"]) for w in res.windows)  # none under the change


def test_a_leaving_rank_admits_nothing_from_the_decision_and_goes_once_it_holds_nothing():
    cfg, sim = _scripted({2.0: 6, 9.0: 5})
    placed: dict[str, tuple[int, float]] = {}
    schedule = sim.sched.schedule

    def spy(now):
        works = schedule(now)
        for rank, w in enumerate(works):
            for s in w.batches[0].seqs:
                placed.setdefault(s.request_id, (rank, now))
        return works
    sim.sched.schedule = spy
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    up, down = res.changes
    assert (down["before"], down["after"]) == (6, 5) and down["done_s"] >= 9.0
    assert sim.layout.dp == 5 and len(sim.sched.pool.groups) == 5
    assert not any(rank == 5 and t > 9.0 for rank, t in placed.values())  # none first scheduled there after
    assert any(rank == 5 for rank, t in placed.values())  # it served some before
    end = res.end_s
    assert res.process_s == pytest.approx(4 * end + (end - 2.0) + (down["done_s"] - 2.0))
    assert not sim.track
