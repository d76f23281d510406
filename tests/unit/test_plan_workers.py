"""``moeflow plan``'s worker processes: a simulation's exception or a worker's death is reported
naming the job, and no worker is left behind (the search once hung in ``Pool.join``)."""
from __future__ import annotations

import os

import pytest

from moeflow.plan.search import _one, _simulated
from moeflow.plan.workers import SimulationFailed, Workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_every_result_comes_back_and_the_workers_leave():
    with Workers(abs, 2) as w:
        pids = [p.pid for p in w.procs]
        assert sorted(w.imap_unordered([-3, 1, -2, 5, 0], str)) == [0, 1, 2, 3, 5]
    assert pids and not any(_alive(p) for p in pids)


def test_a_simulation_that_raises_names_its_candidate_and_the_workers_are_killed():
    job = ("whole", "dep8_broken", (None, {}, None, None))  # evaluate(None, ...): AttributeError in the worker
    with pytest.raises(SimulationFailed, match=r"candidate dep8_broken failed in its worker:(.|\n)*AttributeError"):
        with Workers(_one, 2) as w:
            pids = [p.pid for p in w.procs]
            list(w.imap_unordered([job], lambda j: f"candidate {j[1]}"))
    assert not any(_alive(p) for p in pids)
    with pytest.raises(SimulationFailed, match="simulating candidate dep8_broken failed: AttributeError"):
        list(_simulated([job], None))  # --jobs 1: the same report from the search's own process


def test_a_worker_that_dies_is_reported_by_its_job_not_waited_for():
    with pytest.raises(SimulationFailed, match=r"the worker simulating job 7 died \(exit code 7\)"):
        with Workers(os._exit, 2) as w:
            pids = [p.pid for p in w.procs]
            list(w.imap_unordered([7], lambda j: f"job {j}"))
    assert not any(_alive(p) for p in pids)

