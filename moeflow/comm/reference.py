"""ReferenceTransport: the four primitives as unbounded in-process queues; the oracle.

Obviously correct, single process, no shared memory, no slots, no waiting: one FIFO per lane.
Its delivery rules are the specification the fast transports are tested against: a region is
complete when each of its W lanes holds a message; regions are served round robin; a combine
receive takes the next message of exactly the expert ranks asked for.

A whole deployment can run in one thread on it (mini-sglang's offline mode): set ``pump`` to a
function that makes the other side progress (an expert rank's ``step``) and a receive that
finds nothing calls it until the message is there or it has nothing left to do.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage
from moeflow.comm.weights import RefWeightStore
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    register)


class _Hub:
    pump: Callable[[], bool] | None = None  # runs the other side one step; False: it had nothing to do

    def wait(self, poll):
        msg = poll()
        while msg is None and self.pump is not None and self.pump():
            msg = poll()
        return msg

    def __init__(self, spec):
        # dispatch[rank][lane_id], combine[lane_id][rank]: deque of (header words, payload [n, H] clone)
        lanes, ranks = (spec.num_lanes, spec.num_expert_ranks) if spec is not None else (0, 0)
        self.dispatch = [[deque() for _ in range(lanes)] for _ in range(ranks)]
        self.combine = [[deque() for _ in range(ranks)] for _ in range(lanes)]
        self.weights: dict[int, dict] = {}  # rank -> its published tensors


class RefDispatchSender(DispatchSender):
    def __init__(self, config, region, lane, hub: _Hub):
        super().__init__(config, region, lane)
        self.hub = hub

    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        words = self.header(payload, layer_id, batch_id, tokens_per_expert)
        self.hub.dispatch[rank][self.lane_id].append((words, payload.clone()))
        self.stats.num_sends += 1


class RefDispatchReceiver(DispatchReceiver):
    def __init__(self, config, rank, hub: _Hub):
        super().__init__(config, rank)
        self.hub, self.lanes = hub, hub.dispatch[rank]

    def poll(self) -> DispatchMessage | None:
        return self._scan(lambda lane_id: bool(self.lanes[lane_id]), lambda lane_id, _: self.lanes[lane_id].popleft())

    def recv(self, timeout_s=None):
        return self.hub.wait(self.poll)  # single process: nothing arrives unless the pump runs


class RefCombineSender(CombineSender):
    def __init__(self, config, rank, hub: _Hub):
        super().__init__(config, rank)
        self.hub = hub

    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        words = self.header(payload, layer_id, batch_id)
        self.hub.combine[self.spec.lane_id(region, lane)][self.rank].append((words, payload.clone()))
        self.stats.num_sends += 1


class RefCombineReceiver(CombineReceiver):
    def __init__(self, config, region, lane, hub: _Hub):
        super().__init__(config, region, lane)
        self.hub, self.segments = hub, hub.combine[self.lane_id]
        self._seq = [0] * self.spec.num_expert_ranks

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        if not all(self.segments[e] for e in ranks):
            return None
        out = {}
        for e in ranks:
            (layer_id, batch_id, _n), payload = self.segments[e].popleft()
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def recv(self, ranks, timeout_s=None):
        ranks = list(ranks)
        return self.hub.wait(lambda: self.poll(ranks))


@register
class ReferenceTransport(Transport):
    name = "reference"
    dispatch_sender_cls = RefDispatchSender
    dispatch_receiver_cls = RefDispatchReceiver
    combine_sender_cls = RefCombineSender
    combine_receiver_cls = RefCombineReceiver
    weight_store_cls = RefWeightStore

    def __init__(self, config):
        super().__init__(config)
        self.hub = _Hub(config.spec)

    @property
    def pump(self):
        return self.hub.pump

    @pump.setter
    def pump(self, fn: Callable[[], bool] | None) -> None:
        self.hub.pump = fn

    def endpoint(self, kind, *ids, **extra):
        return super().endpoint(kind, *ids, hub=self.hub, **extra)
