"""The simulator's elastic afd: the engine's controller on simulated windows. Oracle: a policy that may
not move is the fixed system, request for request; a change is carried out as the engine does it
(joiners serve once ready, leaving instances drain first) and every member is paid from its start to
its exit."""
from __future__ import annotations

import dataclasses

import pytest

from moeflow.config import ConfigError
from moeflow.experiment.serve import parse_experiment as parse_config
from moeflow.experiment.system import system_from_dict
from moeflow.scheduler.autoscale import Decision
from moeflow.sim.elastic_afd import ElasticAfdSystem
from moeflow.sim.run import build_cost, make_system, run_point

AFD = {"mode": "afd", "attn_workers": 2, "ffn_workers": 2, "topology": "all", "micro_batches": 2,
       "max_batch_tokens": 8192, "engine": {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024}}
STILL = {"tpot_slo_s": 0.05, "min_attention": 2, "max_attention": 2, "min_ffn": 2, "max_ffn": 2, "sample_s": 1.0,
         "interval_s": 0.0, "window": 1}


def _cfg(**systems):
    return parse_config({"model": "qwen3-235b-a22b", "hardware": "h200", "rps": [4], "slo_ttft_s": 2.0,
                         "slo_tpot_s": 0.05, "systems": systems,
                         "workload": {"kind": "uniform", "isl": 2048, "output_len": 64, "duration_s": 20, "seed": 1}})


def test_a_controller_that_may_not_move_is_the_fixed_system_request_for_request():
    assert_still_is_fixed(AFD, STILL, 4)


def assert_still_is_fixed(system: dict, still: dict, processes: int):
    """``system`` under a policy that may not move (``still``) serves every request as the fixed one, and
    costs its ``processes`` all along; its run's result."""
    cfg = _cfg(fixed=system, elastic={**system, "autoscale": still})
    cost = build_cost(cfg)
    fixed, fres = run_point(cfg.systems["fixed"], cost, cfg, 4.0)
    elastic, eres = run_point(cfg.systems["elastic"], cost, cfg, 4.0)
    assert [dataclasses.astuple(r) for r in fres.records] == [dataclasses.astuple(r) for r in eres.records]
    assert eres.process_s == pytest.approx(processes * eres.end_s)
    assert elastic["process_s"] == pytest.approx(fixed["process_s"])
    assert elastic["goodput_per_process_s"] == pytest.approx(fixed["goodput_per_process_s"])
    assert eres.changes == [] and elastic["sim_busy"] == pytest.approx(fixed["sim_busy"])
    return eres


def _scripted(decisions: dict[float, tuple[int, int]], **policy):
    """An elastic system whose controller decides ``decisions`` (sample time -> members)."""
    cfg = _cfg(elastic={**AFD, "autoscale": {**STILL, "max_attention": 3, "max_ffn": 3, "min_attention": 1,
                                             "min_ffn": 1, **policy}})
    sim = make_system(cfg.systems["elastic"], build_cost(cfg))
    assert isinstance(sim, ElasticAfdSystem)

    def observe(s):
        d = decisions.get(s.t_s)
        return None if d is None else Decision(s.t_s, *d, "scripted", 0.0)

    sim.controller.observe = observe
    return cfg, sim


def test_a_daemon_joins_once_its_experts_are_copied_and_is_paid_from_the_decision():
    from moeflow.measure.workload import generate_requests

    cfg, sim = _scripted({3.0: (2, 3)})
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    (c,) = res.changes
    m = sim.model
    copy = sim.link_cost("ffn", "ffn").transfer_s(m.expert_bytes * m.num_experts * m.num_moe_layers / 3)
    ready = 3.0 + sim.spec.sim.member_start_s + copy
    assert (c["side"], c["before"], c["after"], c["asked_s"]) == ("ffn", 2, 3, 3.0)
    assert ready <= c["done_s"] < ready + 0.5  # the first step boundary after it is ready
    assert sim.layout.ffn_workers == 3 and len(sim.served) == 3
    # 2 instances all along, 2 daemons, a third from the decision
    assert res.process_s == pytest.approx(2 * res.end_s + 2 * res.end_s + (res.end_s - 3.0))
    # the windows the controller was handed, none while the change was under way (as the engine)
    assert res.windows and all(not (3.0 < w["t_s"] < c["done_s"]) for w in res.windows)
    assert {(w["attention"], w["ffn"]) for w in res.windows} == {(2, 2), (2, 3)}


def test_a_leaving_instance_admits_nothing_from_the_decision_and_goes_once_it_holds_nothing():
    from moeflow.measure.workload import generate_requests

    cfg, sim = _scripted({5.0: (1, 2)})
    first_group, arrived = {}, {}
    schedule, add = sim.sched.schedule, sim.sched.add

    def spy_schedule(now):
        works = schedule(now)
        for w in works:
            for b in w.batches:
                for s in b.seqs:
                    first_group.setdefault(s.request_id, w.group)
        return works

    def spy_add(r):
        arrived[r.request_id] = sim.loop.now
        add(r)

    sim.sched.schedule, sim.sched.add = spy_schedule, spy_add
    res = sim.run(generate_requests(cfg.point_workload(4.0, 1)))
    (c,) = res.changes
    assert (c["side"], c["before"], c["after"]) == ("attention", 2, 1) and c["done_s"] > 5.0
    assert len(sim.sched.pool.groups) == 1 and sim.layout.attn_workers == 1
    later = [rid for rid, t in arrived.items() if t > 5.0]
    assert later and all(first_group[rid] == 0 for rid in later)  # none placed on the leaver
    assert any(g == 1 for rid, g in first_group.items() if arrived[rid] <= 5.0)  # it held some before
    assert len(res.records) == len(arrived)
    leaver_s = c["done_s"]  # paid until it was gone
    assert res.process_s == pytest.approx(res.end_s + leaver_s + 2 * res.end_s)


@pytest.mark.parametrize("system,match", [
    ({"mode": "colocated", "autoscale": STILL}, "resizes afd with topology all"),
    ({"mode": "dep", "dp": 2, "autoscale": {"tpot_slo_s": 0.05, "max_ranks": 3}}, r"max_ranks <= max_dp \(None\)"),
    ({"mode": "dep", "dp": 2, "max_dp": 3, "autoscale": STILL}, r"unknown keys \['max_attention'"),
    ({**AFD, "autoscale": {**STILL, "bogus": 1}}, r"unknown keys \['bogus'\]"),
    ({**AFD, "autoscale": {**STILL, "min_attention": 3, "max_attention": 4}}, "outside the policy's range"),
    ({**AFD, "autoscale": {**STILL, "tpot_slo_s": 0}}, "tpot_slo_s must be > 0"),
])
def test_a_bad_autoscale_entry_is_refused_saying_why(system, match):
    with pytest.raises(ConfigError, match=match):
        system_from_dict("e", system, "qwen3-235b-a22b")


def test_an_in_process_deployment_refuses_an_elastic_system_rather_than_run_it_fixed():
    from moeflow import LLM

    with pytest.raises(ConfigError, match="the controller runs in `moeflow serve --autoscale`"):
        LLM.from_system(system_from_dict("e", {**AFD, "autoscale": STILL}))


def test_decode_side_arrivals_land_with_their_kv_and_wait_for_room_first_come_first_served():
    """sim.decode_side: no prefill runs; a request's first token came with it; with room for few, the
    rest wait in arrival order and the wait shows in their TPOT."""
    from moeflow.measure.workload import generate_requests

    small = {**AFD, "sim": {"decode_side": True},
             "engine": {"num_kv_blocks": 24, "kv_block_size": 256, "max_num_seqs": 1024}}  # 3 prompts of 2K a group
    cfg = _cfg(small=small)
    cost = build_cost(cfg)
    sim = make_system(cfg.systems["small"], cost)
    admitted = []
    arrive = sim.handoff_port

    def port():
        p = arrive()
        real = p.arrive

        def spy(r):
            admitted.append((sim.loop.now, r.arrival_s, r.request_id))
            real(r)
        p.arrive = spy
        return p

    sim.handoff_port = port
    work = generate_requests(cfg.point_workload(4.0, 1))
    res = sim.run(work)
    assert len(res.records) == len(work) and all(r.ttft_s == 0.0 for r in res.records)  # the token came with it
    assert [a for _, a, _ in admitted] == sorted(a for _, a, _ in admitted)  # first come, first served
    assert max(now - a for now, a, _ in admitted) > 1.0  # some waited for room
    by_arrival = {r.arrival_s: r for r in res.records}
    for now, a, _ in admitted:  # the wait for room is in TPOT: its first token came at arrival
        rec = by_arrival[a]
        assert rec.tpot_s >= (now - a) / (rec.num_output - 1)
    with pytest.raises(ValueError, match="modelled for dep and afd"):
        asap = _cfg(a={"mode": "asap", "sim": {"decode_side": True},
                       "engine": {"num_kv_blocks": 4096, "kv_block_size": 256, "max_num_seqs": 1024}})
        run_point(asap.systems["a"], cost, asap, 4.0)


def test_a_handed_over_request_never_lands_on_a_group_that_drains():
    from moeflow.core import Request, SamplingParams
    from moeflow.scheduler import groups

    cfg = _cfg(e={**AFD, "sim": {"decode_side": True}})
    sim = make_system(cfg.systems["e"], build_cost(cfg))
    port = sim.handoff_port()
    r = Request("x", range(100), SamplingParams(max_tokens=4), output_token_ids=[0])
    assert port.room(r) in (0, 1)
    groups.drain(sim.sched, 0)
    assert port.room(r) == 1
    groups.drain(sim.sched, 1)
    assert port.room(r) is None


@pytest.mark.parametrize("mode", ["dep", "afd"])
def test_a_request_preempted_on_a_draining_group_comes_back_to_it(mode):
    """Its state is on that group's workers, so it may only return there; the placement leaves a
    draining group, and before the fix nothing readmitted it: the group never settled."""
    from moeflow.config import EngineConfig
    from moeflow.core import Request, SamplingParams
    from moeflow.layout import make_layout
    from moeflow.scheduler import groups, make_scheduler

    layout = make_layout(mode, **({"dp": 2} if mode == "dep" else {"attn_workers": 2, "ffn_workers": 1}))
    sched = make_scheduler(layout, EngineConfig(num_kv_blocks=64, kv_block_size=16), 4096)
    for i in range(4):
        sched.add(Request(f"r{i}", range(32), SamplingParams(max_tokens=8)))
    sched.schedule()
    pool = sched.pool
    victim = pool.groups[1].requests[0]
    pool.preempt(victim)
    groups.drain(sched, 1)
    sched.schedule()
    assert pool.group_of[victim.request_id] == 1 and victim.request_id not in pool.pinned
