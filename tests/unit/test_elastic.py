"""An elastic deployment's membership requests: what is refused, and why."""
from __future__ import annotations

import pytest

from moeflow.config import ConfigError
from moeflow.engine.elastic import Membership, ScaleEvent


def _membership() -> Membership:
    return Membership("ffn", 3, spawn=lambda i, join: None, on_switch=lambda n: None)


def test_a_target_is_checked_against_capacity_experts_and_the_change_under_way():
    m = _membership()
    with pytest.raises(ConfigError, match=r"4 is outside \[1, 3\] .*max_ffn_workers"):
        m.ask(4, 2, 8, (4, 4))
    with pytest.raises(ConfigError, match=r"1 ffn workers of 4 slots hold 4 experts, fewer than the model's 8"):
        m.ask(1, 2, 8, (4, 4))
    m.ask(2, 2, 8, (4, 4))  # already there: nothing to do
    assert m.pending is None and not m.busy
    m.ask(3, 2, 8, (4, 4))
    assert m.pending == 3 and m.busy and m.status(2)["target"] == 3
    with pytest.raises(ConfigError, match="a change to 3 is under way"):
        m.ask(2, 2, 8, (4, 4))
    m.pending = None
    m.events.append(ScaleEvent("ffn", 2, 3, requested_s=10.0, switched_s=12.5))
    s = m.status(2)
    assert s["in_progress"] and s["events"][0]["seconds"] == 2.5 and s["events"][0]["outcome"] == "running"
    m.events[-1].outcome = "done"
    assert not m.status(3)["in_progress"] and m.status(3)["target"] == 3
