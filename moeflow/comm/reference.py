"""ReferenceTransport: the four primitives as unbounded in-process queues; the oracle.

Obviously correct, single process, no shared memory, no slots, no waiting: one FIFO per lane.
Its delivery rules are the specification the fast transports are tested against: a region is
complete when each of its T lanes holds a message; regions are served round robin; a combine
receive takes the next message of exactly the workers asked for.

A whole deployment can run in one thread on it (mini-sglang's offline mode): set ``pump`` to a
function that makes the other side progress (an expert worker's ``step``) and a receive that
finds nothing calls it until the message is there or it has nothing left to do.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage
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
        # dispatch[e][lane], combine[rank][e]: deque of (header words, payload [n, H] clone)
        self.dispatch = [[deque() for _ in range(spec.num_attention_ranks)] for _ in range(spec.num_moe_workers)]
        self.combine = [[deque() for _ in range(spec.num_moe_workers)] for _ in range(spec.num_attention_ranks)]


class RefDispatchSender(DispatchSender):
    def __init__(self, config, group, member, hub: _Hub):
        super().__init__(config, group, member)
        self.hub = hub

    def send(self, worker, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        words = self.header(payload, layer_id, batch_id, tokens_per_expert)
        self.hub.dispatch[worker][self.lane].append((words, payload.clone()))
        self.stats.num_sends += 1


class RefDispatchReceiver(DispatchReceiver):
    def __init__(self, config, worker, hub: _Hub):
        super().__init__(config, worker)
        self.hub, self.lanes = hub, hub.dispatch[worker]

    def poll(self) -> DispatchMessage | None:
        return self._scan(lambda lane: bool(self.lanes[lane]), lambda lane, j: self.lanes[lane].popleft())

    def recv(self, timeout_s=None):
        return self.hub.wait(self.poll)  # single process: nothing arrives unless the pump runs


class RefCombineSender(CombineSender):
    def __init__(self, config, worker, hub: _Hub):
        super().__init__(config, worker)
        self.hub = hub

    def send(self, group, member, payload, layer_id, batch_id) -> None:
        words = self.header(payload, layer_id, batch_id)
        self.hub.combine[self.spec.attention_rank(group, member)][self.worker].append((words, payload.clone()))
        self.stats.num_sends += 1


class RefCombineReceiver(CombineReceiver):
    def __init__(self, config, group, member, hub: _Hub):
        super().__init__(config, group, member)
        self.hub, self.segments = hub, hub.combine[self.spec.attention_rank(group, member)]
        self._seq = [0] * self.spec.num_moe_workers

    def poll(self, workers: Sequence[int]) -> CombineMessage | None:
        if not all(self.segments[e] for e in workers):
            return None
        out = {}
        for e in workers:
            (layer_id, batch_id, _n), payload = self.segments[e].popleft()
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def recv(self, workers, timeout_s=None):
        workers = list(workers)
        return self.hub.wait(lambda: self.poll(workers))


@register
class ReferenceTransport(Transport):
    name = "reference"

    def __init__(self, config):
        super().__init__(config)
        self.hub = _Hub(config.spec)

    @property
    def pump(self):
        return self.hub.pump

    @pump.setter
    def pump(self, fn: Callable[[], bool] | None) -> None:
        self.hub.pump = fn

    def dispatch_sender(self, group, member):
        return RefDispatchSender(self.config, group, member, self.hub)

    def dispatch_receiver(self, worker):
        return RefDispatchReceiver(self.config, worker, self.hub)

    def combine_sender(self, worker):
        return RefCombineSender(self.config, worker, self.hub)

    def combine_receiver(self, group, member):
        return RefCombineReceiver(self.config, group, member, self.hub)
