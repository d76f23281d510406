"""``moeflow plan``'s worker processes: a simulation's exception or a worker's death is reported
naming the job, and no worker is left behind (the search once hung in ``Pool.join``)."""
from __future__ import annotations

import os

import pytest

from moeflow.bench.server_process import is_alive
from moeflow.plan.search import _one, _simulated
from moeflow.plan.workers import SimulationFailed, Workers



def test_every_result_comes_back_and_the_workers_leave():
    with Workers(abs, 2) as w:
        pids = [p.pid for p in w.procs]
        assert sorted(w.imap_unordered([-3, 1, -2, 5, 0], str)) == [0, 1, 2, 3, 5]
    assert pids and not any(is_alive(p) for p in pids)


def test_a_simulation_that_raises_names_its_candidate_and_the_workers_are_killed():
    job = ("whole", "dep8_broken", (None, {}, None, None))  # evaluate(None, ...): AttributeError in the worker
    with pytest.raises(SimulationFailed, match=r"candidate dep8_broken failed in its worker:(.|\n)*AttributeError"):
        with Workers(_one, 2) as w:
            pids = [p.pid for p in w.procs]
            list(w.imap_unordered([job], lambda j: f"candidate {j[1]}"))
    assert not any(is_alive(p) for p in pids)
    with pytest.raises(SimulationFailed, match="simulating candidate dep8_broken failed: AttributeError"):
        list(_simulated([job], None))  # --jobs 1: the same report from the search's own process


def test_a_worker_that_dies_is_reported_by_its_job_not_waited_for():
    with pytest.raises(SimulationFailed, match=r"the worker simulating job 7 died \(exit code 7\)"):
        with Workers(os._exit, 2) as w:
            pids = [p.pid for p in w.procs]
            list(w.imap_unordered([7], lambda j: f"job {j}"))
    assert not any(is_alive(p) for p in pids)



def test_simulating_the_next_round_ahead_changes_no_pick_and_no_result(monkeypatch):
    """Four processes of tiny on this machine's profile, two at a time: the rounds with an idle
    worker simulating ahead pick and rank exactly what rounds without it do, and it did run ahead."""
    from moeflow.plan import search as plan_search
    from moeflow.plan.candidates import enumerate_candidates
    from test_plan import BASE

    cands = [c for c in enumerate_candidates(4) if c.name in ("dep4", "dep2_tp2", "dwdp4", "afd_2a2f_m2", "afd_3a1f_m1",
                                                               "pd_dep1_dep1", "pd_dep1_dep2", "pd_dep2_dep1")]
    slo = plan_search.Slo(2.0, 0.5, "p90")
    ahead_of_round = []
    real_round, real_submit = plan_search._round, Workers.submit

    def spy_round(workers, jobs, *a, **k):
        spy_round.names = {j[1] for j in jobs}
        return real_round(workers, jobs, *a, **k)

    def spy_submit(self, job):
        if job[0] == "whole" and job[1] not in spy_round.names:
            ahead_of_round.append(job[1])
        return real_submit(self, job)

    monkeypatch.setattr(plan_search, "_round", spy_round)
    monkeypatch.setattr(Workers, "submit", spy_submit)
    run = lambda: _without_wall(plan_search.search(cands, BASE, slo, None, jobs=2, progress=None, memory_gib=2.0,
                                                   confirm=5, top=3))
    ahead = run()
    assert ahead_of_round, "no whole simulation ran ahead of its round"
    monkeypatch.setattr(plan_search, "AHEAD", False)
    assert run() == ahead and sum(not r.get("estimated", True) for r in ahead) == 5


def _without_wall(x):
    if isinstance(x, dict):
        return {k: _without_wall(v) for k, v in x.items() if k != "wall_s"}
    if isinstance(x, list):
        return [_without_wall(v) for v in x]
    return x
