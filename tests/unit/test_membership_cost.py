"""Process-seconds of an elastic deployment from its scale events: joiners from the ask, leavers to
their exit, failures left out."""
from __future__ import annotations

import pytest

from moeflow.measure.membership_cost import process_seconds


def _e(before, after, asked, switched=None, left=None, outcome="done"):
    return {"before": before, "after": after, "requested_s": asked, "switched_s": switched, "left_s": left,
            "outcome": outcome}


def test_joiners_cost_from_the_ask_and_leavers_until_they_exit():
    assert process_seconds(3, [], 10.0, 20.0) == 30.0
    up = _e(1, 2, 12.0, switched=15.0, left=15.0)  # loading its weights from 12 to 15 costs too
    assert process_seconds(3, [up], 10.0, 20.0) == 30.0 + 8.0
    down = _e(2, 1, 14.0, switched=14.0, left=16.0)  # drains until 16
    assert process_seconds(3, [up, down], 10.0, 20.0) == 38.0 - 4.0
    running = _e(1, 3, 18.0, outcome="running")  # started, not serving yet: two processes already
    assert process_seconds(3, [running], 10.0, 20.0) == 34.0


def test_failed_changes_and_those_outside_the_span_are_left_out():
    failed = _e(1, 2, 12.0, outcome="failed: ffn worker 1 exited")
    before = _e(1, 2, 5.0, switched=6.0, left=6.0)  # counted in the members at the start
    assert process_seconds(3, [failed, before], 10.0, 20.0) == 30.0
    with pytest.raises(ValueError, match="t1_s >= t0_s"):
        process_seconds(3, [], 20.0, 10.0)


def test_a_member_of_several_processes_costs_them_all():
    up = {**_e(1, 2, 12.0, switched=15.0, left=15.0), "kind": "prefill"}  # a pd prefill instance of 2 processes
    down = {**_e(2, 1, 14.0, switched=14.0, left=16.0), "kind": "decode"}  # a decode instance of 3
    assert process_seconds(5, [up, down], 10.0, 20.0, {"prefill": 2, "decode": 3}) == 50.0 + 2 * 8.0 - 3 * 4.0
