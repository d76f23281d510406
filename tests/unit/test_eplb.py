"""The EPLB placement (scheduler/eplb.py) and the expert map it returns: DeepSeek's published
example, and the properties every placement must have."""
import random

import pytest

from moeflow.config import ConfigError
from moeflow.scheduler.eplb import pack, rebalance, replicate
from moeflow.layout.expert_map import ExpertMap, balancedness, slot_counts

# deepseek-ai/EPLB's README: 2 layers x 12 experts, 4 redundant, 4 groups, 2 nodes x 4 GPUs
WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
PUBLISHED = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
             [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_the_published_example():
    m = rebalance(WEIGHT, num_devices=8, num_redundant=4, num_groups=4, num_nodes=2)
    assert [m.physical(l) for l in range(2)] == PUBLISHED
    assert m.slots_per_device == (2,) * 8 and m.num_redundant == 4


def _random_load(rng, layers, experts, skew):
    return [[rng.paretovariate(skew) for _ in range(experts)] for _ in range(layers)]


@pytest.mark.parametrize("experts,devices,redundant,groups,nodes,policy", [
    (12, 8, 4, 4, 2, "auto"), (16, 4, 0, 1, 1, "global"), (16, 4, 4, 1, 1, "global"), (10, 4, 3, 1, 1, "global"),
    (64, 8, 8, 8, 2, "hierarchical"), (60, 7, 11, 1, 1, "auto"), (8, 3, 2, 4, 2, "auto")])
def test_every_placement_keeps_the_properties(experts, devices, redundant, groups, nodes, policy):
    rng = random.Random(experts * devices + redundant)
    load = _random_load(rng, 3, experts, 1.2)
    m = rebalance(load, devices, redundant, groups, nodes, policy)
    assert m.slots_per_device == slot_counts(experts + redundant, devices)
    assert m.num_slots == experts + redundant
    for l in range(3):
        reps = m.replicas(l)
        assert all(len(r) >= 1 for r in reps)  # every logical expert has a replica
        assert sum(len(r) for r in reps) == experts + redundant
        hottest = max(range(experts), key=lambda e: load[l][e])
        if m.num_redundant and (policy == "global" or nodes == 1):  # hierarchical: the most within its node
            assert len(reps[hottest]) == max(len(r) for r in reps)  # the hottest gets the most replicas
        for ids in m.layers[l]:
            assert len(set(ids)) == len(ids) or redundant >= devices  # no expert twice on one device if avoidable


def test_redundant_experts_improve_balance_on_a_skewed_load():
    rng = random.Random(1)
    load = _random_load(rng, 4, 32, 1.1)
    plain = ExpertMap.contiguous(32, 4, 4).balancedness(load)
    eplb0 = rebalance(load, 4, 0).balancedness(load)
    eplb8 = rebalance(load, 4, 8).balancedness(load)
    assert all(b0 >= p - 1e-9 for b0, p in zip(eplb0, plain))  # packing alone never loses to contiguous here
    assert sum(eplb8) / 4 > sum(plain) / 4 and min(eplb8) > 0.8


def test_a_balanced_load_changes_nothing_without_redundancy():
    load = [[5.0] * 16 for _ in range(2)]
    now = ExpertMap.contiguous(16, 4, 2)
    assert rebalance(load, 4, 0, current=now) == now
    assert rebalance(load, 4, 0).balancedness(load) == [1.0, 1.0]


def test_a_rebalance_over_the_current_placement_moves_few_slots():
    rng = random.Random(3)
    load = _random_load(rng, 4, 32, 1.1)
    now = ExpertMap.contiguous(32, 4, 4, num_redundant=4)
    fresh, laid = rebalance(load, 4, 4), rebalance(load, 4, 4, current=now)
    assert laid.balancedness(load) == fresh.balancedness(load)  # the same sets, given to other devices
    assert len(now.moves(laid)) < len(now.moves(fresh))
    again = rebalance(load, 4, 4, current=laid)
    assert again == laid  # the same load: nothing moves


def test_replicate_and_pack():
    assert replicate([10, 1, 4], 5) == [0, 1, 2, 0, 0]  # 10 per copy, then 5 per copy still beats 4
    assert pack([5, 4, 3, 3], [2, 2]) == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert pack([5, 5, 1], [2, 1], labels=[7, 7, 8]) == [(0, 0), (1, 0), (0, 1)]  # the second copy avoids device 0


def test_moves_names_every_slot_that_changes():
    a = ExpertMap.contiguous(4, 2, 2)
    b = ExpertMap((((0, 1), (2, 3)), ((0, 2), (1, 3))), 4)
    assert a.moves(b) == [(1, 0, 1, 2), (1, 1, 0, 1)]
    assert a.moves(a) == []


def test_bad_inputs_are_refused_naming_the_numbers():
    with pytest.raises(ConfigError, match="num_redundant_experts must be >= 0, got -1"):
        rebalance(WEIGHT, 8, -1)
    with pytest.raises(ConfigError, match="9 expert devices for 8 expert slots"):
        slot_counts(8, 9)
    with pytest.raises(ConfigError, match="leaves experts \\[3\\] in no slot"):
        ExpertMap((((0, 1), (2, 2)),), 4)
    with pytest.raises(ConfigError, match="hierarchical placement needs"):
        rebalance(WEIGHT, 8, 4, num_groups=3, num_nodes=2, policy="hierarchical")
    assert balancedness([0.0, 0.0]) == 1.0 and balancedness([1.0, 3.0]) == pytest.approx(2 / 3)


def test_resize_keeps_every_survivor_its_slots_and_most_of_its_experts():
    from moeflow.scheduler.eplb import resize

    now = ExpertMap.contiguous(8, 2, 3)  # 2 devices of 4 slots, 3 layers
    load = [[5, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 9], [1] * 8]
    grown = resize(now, 3, load)
    assert grown.slots_per_device == (4, 4, 4) and grown.num_experts == 8
    # survivors move nothing; the joiner holds replicas, the hottest per copy first, one copy each
    assert all(grown.layers[lid][:2] == now.layers[lid] for lid in range(3))
    assert grown.layers[0][2] == (0, 1, 2, 3) and grown.layers[1][2] == (7, 0, 1, 2)
    assert now.moves(resize(grown, 2)) == []  # and leaving it again moves nothing back
    # the last device leaves: what only it held takes the coldest spare copies' slots on survivors
    shrunk = resize(ExpertMap(((((0, 1, 2), (3, 0, 1), (4, 5, 0)),)), 6), 2, [[9, 1, 4, 2, 1, 1]])
    # 4 takes the coldest spare copy's slot (1's first), then 5 the only spare left (0's first)
    assert shrunk.layers[0] == ((5, 4, 2), (3, 0, 1))
    with pytest.raises(ConfigError, match=r"1 expert devices of \[4\] slots hold 4 experts, fewer than the model's 8"):
        resize(now, 1)
    assert resize(shrunk, 3).slots_per_device == (3, 3, 3)
    uneven = ExpertMap.contiguous(4, 3, 1, num_redundant=3)  # 2, 2, 3 slots: a fourth of 3 is no even share
    assert resize(uneven, 2).slots_per_device == (2, 2)
    with pytest.raises(ConfigError, match=r"devices of \[2, 2, 3\] slots cannot become 4 devices of equal shares"):
        resize(uneven, 4)
