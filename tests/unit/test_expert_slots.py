"""A live rebalance's weight movement (workers/expert_slots.py) through real shared memory: with
arange-encoded experts (each slot's values name its layer and logical expert), every slot holds
its new expert after each move, in the buffer of the new placement, and the live one is untouched."""
import threading
import uuid

import torch

from moeflow.comm import CommConfig, list_segments
from moeflow.comm.weights import ShmWeightStore
from moeflow.layout.expert_map import ExpertMap
from moeflow.messages import MoveExperts
from moeflow.model.moe import ExpertWeights
from moeflow.scheduler.eplb import rebalance
from moeflow.workers.expert_slots import ExpertSlots
from moeflow.workers.tracer import Tracer

E, LAYERS, H, F = 6, 3, 8, 4


def _code(layer: int, expert: int) -> float:
    return 100.0 * layer + expert


def _weights(held: tuple[int, ...]) -> ExpertWeights:
    w13 = torch.empty(LAYERS, len(held), 2 * F, H)
    w2 = torch.empty(LAYERS, len(held), H, F)
    for l in range(LAYERS):
        for s, e in enumerate(held):
            w13[l, s] = _code(l, e)
            w2[l, s] = -_code(l, e)
    return ExpertWeights(w13, w2, tuple(range(LAYERS)), held)


def _move(slots: list[ExpertSlots], epoch: int, new: ExpertMap) -> None:
    done = threading.Barrier(len(slots) + 1)
    for s in slots:
        s.begin(MoveExperts(epoch, new.layers), lambda msg: done.wait(timeout=10))
    done.wait(timeout=10)
    for s in slots:
        s.check()


def _assert_holds(slots: list[ExpertSlots], parity: int, m: ExpertMap) -> None:
    for d, s in enumerate(slots):
        w = s.weights[parity]
        for l in range(LAYERS):
            assert w.slots[l] == m.layers[l][d]
            for i, e in enumerate(m.layers[l][d]):
                assert torch.all(w.w13[l, i] == _code(l, e)) and torch.all(w.w2[l, i] == -_code(l, e))


def test_every_slot_holds_its_new_expert_after_each_move():
    cfg = CommConfig(None, "shm", f"test-{uuid.uuid4().hex[:8]}")
    start = ExpertMap.contiguous(E, 3, LAYERS, num_redundant=3)
    slots = [ExpertSlots("moe", d, _weights(start.layers[0][d]), start.layers, ShmWeightStore(cfg), Tracer("moe", d, False))
             for d in range(3)]
    try:
        g = torch.Generator().manual_seed(0)
        current = start
        for epoch in range(1, 5):  # placements alternate buffers: 1, 0, 1, 0
            load = (torch.rand(LAYERS, E, generator=g) ** 4 * 100).tolist()
            new = rebalance(load, 3, 3, current=None if epoch % 2 else current)  # fresh and laid-over maps
            assert current.moves(new), "the test needs placements that move experts"
            _move(slots, epoch, new)
            _assert_holds(slots, epoch % 2, new)
            _assert_holds(slots, 1 - epoch % 2, current)  # the live buffer served on, untouched
            current = new
    finally:
        for s in slots:
            s.close()
    assert list_segments(cfg.deployment_id) == []  # each published pair of buffers unlinked by its owner


def test_a_joiner_fills_its_slots_from_its_peers_and_refuses_the_parity_it_never_held():
    """A worker that joins (``ExpertSlots.joining``) reads its slots of the new placement from the live
    workers' buffers; a dispatch routed by the old placement's parity would find its empty buffer,
    so it is refused rather than computed with zeros."""
    import pytest

    from moeflow.membership_messages import JoinExperts
    from moeflow.scheduler.eplb import resize
    from moeflow.workers.dispatch import tag_layer

    cfg = CommConfig(None, "shm", f"test-{uuid.uuid4().hex[:8]}")
    start = ExpertMap.contiguous(E, 2, LAYERS)
    live = [ExpertSlots("moe", d, _weights(start.layers[0][d]), start.layers, ShmWeightStore(cfg), Tracer("moe", d, False))
            for d in range(2)]
    new = resize(start, 3, [[float(e) for e in range(E)]] * LAYERS)  # the joiner holds replicas of the hottest
    joiner = ExpertSlots.joining("moe", 2, tuple(range(LAYERS)), (len(new.layers[0][2]), 2 * F, H, F), torch.float32,
                                 "cpu", JoinExperts(1, new.layers, start.layers), ShmWeightStore(cfg),
                                 Tracer("moe", 2, False))
    try:
        _move([joiner], 1, new)
        w = joiner.for_word(tag_layer(0, 1))[1]
        for l in range(LAYERS):
            for i, e in enumerate(new.layers[l][2]):
                assert torch.all(w.w13[l, i] == _code(l, e)) and torch.all(w.w2[l, i] == -_code(l, e))
        with pytest.raises(RuntimeError, match="never received"):
            joiner.for_word(tag_layer(0, 0))
        assert joiner.shape().num_local == len(new.layers[0][2])
    finally:
        for s in live + [joiner]:
            s.close()
    assert list_segments(cfg.deployment_id) == []
