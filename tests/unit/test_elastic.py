"""An elastic deployment's membership requests: what is refused, and why."""
from __future__ import annotations

import pytest

from moeflow.config import ConfigError
from moeflow.engine.elastic import Membership
from moeflow.engine.scale_event import ScaleEvent


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


def test_across_hosts_only_the_expert_holders_scale_and_on_one_host_of_their_own():
    """Across hosts the expert holders join through pair links (transport ``pairs``); attention
    members join on the engine's host only, and the expert holders must share one host."""
    from moeflow.cluster_config import ClusterConfig
    from moeflow.config import EngineConfig
    from moeflow.engine.elastic import check_elastic
    from moeflow.layout import make_layout

    two, three = (EngineConfig(cluster=ClusterConfig(nnodes=n)) for n in (2, 3))
    afd = dict(attn_workers=2, ffn_workers=1, topology="all")
    check_elastic(two, make_layout("afd", **afd, max_ffn_workers=2))  # accepted
    with pytest.raises(ConfigError, match="max_attn_workers: attention members join on the engine's host only"):
        check_elastic(two, make_layout("afd", **afd, max_ffn_workers=2, max_attn_workers=3))
    with pytest.raises(ConfigError, match="max_attn_dp: attention members join on the engine's host only"):
        check_elastic(two, make_layout("asap", attn_dp=1, moe_workers=1, max_attn_dp=2))
    with pytest.raises(ConfigError, match="spreads them over 2 hosts: run it on 2 nodes"):
        check_elastic(three, make_layout("asap", attn_dp=1, moe_workers=1, max_moe_workers=2))
