"""A deployment's starting placement (``--init-expert-location``): trivial, from recorded load, or
an explicit slot map; and every way a file can be wrong, named."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moeflow.config import ConfigError
from moeflow.engine.expert_load import ExpertLoadWindow
from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.eplb import rebalance
from moeflow.scheduler.expert_location import TRIVIAL, initial_map

E, MOE = 8, [1, 3]  # two MoE layers (model layers 1 and 3) of 8 experts
HELD = ExpertMap.contiguous(E, 2, 1, num_redundant=2).layers[0]  # 10 slots over 2 devices: 5 + 5
COUNT = [[5, 5, 90, 5, 5, 5, 5, 5], [1, 1, 1, 1, 1, 1, 60, 60]]  # layer 1: expert 2 hot; layer 3: 6 and 7


def _file(tmp_path, data, name="loc.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def test_trivial_is_the_layouts_placement_in_every_layer():
    m = initial_map(TRIVIAL, HELD, E, MOE)
    assert m.layers == (HELD, HELD) and m.num_redundant == 2


def test_recorded_load_is_placed_by_the_eplb_policy_layer_by_layer(tmp_path):
    m = initial_map(_file(tmp_path, {"logical_count": COUNT, "moe_layers": MOE, "num_experts": E}), HELD, E, MOE)
    assert m == rebalance(COUNT, 2, 2)
    assert m.layers[0] != m.layers[1]  # a different placement per layer, each for its own load
    assert [len(r) for r in m.replicas(0)][2] == 3 and [len(r) for r in m.replicas(1)][6:] == [2, 2]
    trivial = initial_map(TRIVIAL, HELD, E, MOE)
    assert all(a > b for a, b in zip(m.balancedness(COUNT), trivial.balancedness(COUNT)))
    assert m.slots_per_device == trivial.slots_per_device  # the deployment's slots, whatever the file


def test_an_explicit_slot_map_is_taken_as_it_is(tmp_path):
    want = rebalance(COUNT, 2, 2)
    rows = [want.physical(0), want.physical(1)]
    assert initial_map(_file(tmp_path, {"physical_to_logical_map": rows}), HELD, E, MOE) == want


def test_a_recorded_window_is_a_file_the_next_deployment_starts_from(tmp_path):
    w = ExpertLoadWindow(ExpertMap((HELD, HELD), E), MOE, window_size=1)
    w.add(np.array(COUNT))
    w.add(np.array(COUNT))  # the window keeps one work item; the recording keeps both
    d = w.distribution()
    assert d == {"logical_count": (2 * np.array(COUNT)).tolist(), "moe_layers": MOE, "num_experts": E, "work_items": 2}
    assert initial_map(_file(tmp_path, d), HELD, E, MOE) == rebalance(d["logical_count"], 2, 2)


@pytest.mark.parametrize("data,words", [
    ("{not json", "is not readable JSON"),
    ([1, 2], "must hold a JSON object, got list"),
    ({}, "exactly one of ['logical_count', 'physical_to_logical_map'], it holds neither"),
    ({"logical_count": COUNT, "physical_to_logical_map": [[0]]}, "it holds ['logical_count', 'physical_to_logical_map']"),
    ({"logical_count": COUNT, "load": 1}, "unknown keys ['load']"),
    ({"logical_count": COUNT[:1]}, "a list of 2 rows (one per MoE layer), got 1 rows"),
    ({"logical_count": [[1] * 7, [1] * 8]}, "8 finite non-negative numbers per layer"),
    ({"logical_count": [[-1] + [1] * 7, [1] * 8]}, "8 finite non-negative numbers per layer"),
    ({"logical_count": [[float("nan")] * 8, [1] * 8]}, "8 finite non-negative numbers"),  # Python reads NaN
    ({"logical_count": COUNT, "num_experts": 16}, "recorded for 16 experts, the model has 8"),
    ({"logical_count": COUNT, "moe_layers": [0, 1]}, "recorded for MoE layers [0, 1], the model's are [1, 3]"),
    ({"physical_to_logical_map": [list(range(8)), list(range(8))]},
     "needs 10 expert ids per layer (this deployment's slots: [5, 5] per device)"),
    ({"physical_to_logical_map": [[0] * 10, list(range(8)) + [0, 1]]}, "layer 0 leaves experts [1, 2, 3, 4, 5, 6, 7]"),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, data, words):
    path = _file(tmp_path, json.dumps(data, allow_nan=True) if not isinstance(data, str) else data)
    with pytest.raises(ConfigError, match="init_expert_location|expert map") as e:
        initial_map(path, HELD, E, MOE)
    assert words in str(e.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="'/no/such.json' is neither 'trivial' nor a file"):
        initial_map("/no/such.json", HELD, E, MOE)
