"""The engine's expert-load window and the /metrics gauges made from it."""
import numpy as np
import pytest

from moeflow.engine.expert_load import ExpertLoadWindow
from moeflow.layout.expert_map import ExpertMap
from moeflow.server.health import Snapshot
from moeflow.server.metrics import ServerMetrics


def test_the_window_keeps_the_last_reports_and_prices_devices_by_the_placement():
    m = ExpertMap((((0, 1), (2, 3, 0)),), 4)  # expert 0 on both devices
    w = ExpertLoadWindow(m, [3], window_size=2)
    w.add(np.array([[10, 0, 0, 0]]))
    w.add(None)  # a work item that routed nothing is no bucket
    w.add(np.array([[2, 2, 2, 2]]))
    w.add(np.array([[4, 0, 0, 4]]))
    assert w.window.tolist() == [[6, 2, 2, 6]] and w.total.tolist() == [[16, 2, 2, 6]]
    assert w.map.device_load(w.window.tolist()) == [[3 + 2, 3 + 2 + 6]]  # expert 0's 6 split over its two copies
    assert w.balancedness() == [pytest.approx(8 / 11)]
    assert w.hottest(2) == [(3, 0, 6 / 16), (3, 3, 6 / 16)]
    with pytest.raises(ValueError, match="positive number of steps, got 0"):
        ExpertLoadWindow(m, [3], window_size=0)


def test_metrics_export_the_placement_and_its_balance():
    metrics = ServerMetrics(60.0, lambda: 0.0)
    snap = Snapshot(True, None, 0, eplb_physical_experts=10, eplb_balancedness=((1, 0.75), (3, 0.5)),
                    eplb_hottest=((1, 4, 0.3),))
    metrics.watch(lambda: snap)
    text = metrics.render().decode()
    assert "moeflow_eplb_physical_experts 10.0" in text
    assert 'moeflow_eplb_balancedness{layer="1"} 0.75' in text and 'moeflow_eplb_balancedness{layer="3"} 0.5' in text
    assert 'moeflow_eplb_hottest_expert_share{expert="4",layer="1"} 0.3' in text
    metrics2 = ServerMetrics(60.0, lambda: 0.0)
    metrics2.watch(lambda: Snapshot(True, None, 0))  # colocated: no expert devices, no gauges
    assert "moeflow_eplb" not in metrics2.render().decode()


def test_the_gate_skew_tilts_the_choice_not_the_weights():
    import torch

    from moeflow.model.gate import GateWeights, route, skewed
    g = torch.Generator().manual_seed(0)
    gate = GateWeights(torch.randn(16, 8, generator=g))
    assert skewed(gate, 3, 0.0) is gate
    a, b = skewed(gate, 3, 1.0), skewed(gate, 3, 1.0)
    assert torch.equal(a.skew, b.skew) and not torch.equal(a.skew, skewed(gate, 4, 1.0).skew)  # per layer
    x = torch.randn(4000, 8, generator=g)
    ids0, w0 = route(x, gate.weight, 2, False)
    ids1, w1 = route(x, gate.weight, 2, False, a.skew)
    probs = torch.softmax(x @ gate.weight.T, dim=-1)
    assert torch.allclose(w1, probs.gather(1, ids1))  # the chosen experts' own probabilities
    hot = int(torch.argmax(a.skew))  # rank 0: no tilt; every other expert is tilted down
    assert (ids1 == hot).sum() > (ids0 == hot).sum()
    cv = [(c.std() / c.mean()).item() for c in (torch.bincount(i.flatten(), minlength=16).float() for i in (ids0, ids1))]
    assert cv[1] > cv[0] + 0.15
