"""DistTransport: the same primitives across hosts, over torch.distributed isend/irecv.

Every endpoint is a set of lanes (``lanes.py``: pre-posted receives, staged isends, one completion
thread per peer) to the ranks of the process's world.

The process group is the caller's: ``dist.init_process_group`` before, destroy after closing.
Closing is collective: every process closes its senders (each fills its peers' pre-posted
receives with goodbye headers: no thread waits on a receive that never comes), then its
receivers (which wait for those goodbyes), then destroys the group.
"""
from __future__ import annotations

from typing import Sequence

from moeflow.comm.doorbell import EventDoorbell
from moeflow.comm.lanes import LaneReceiver, LaneSender
from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    private_rows, register)

DISPATCH_TAG, COMBINE_TAG = 0, 16  # + slot


class DistDispatchSender(DispatchSender):
    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        peers = [self.spec.expert_world_rank(e) for e in range(self.spec.num_expert_ranks)]
        self.lanes = LaneSender(config, peers, DISPATCH_TAG, self.spec.dispatch_header_words,
                                self.spec.dispatch_rows, self.stats)

    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        self.lanes.write(rank, self.header(payload, layer_id, batch_id, tokens_per_expert), payload)

    def close(self) -> None:
        self.lanes.close()


class DistDispatchReceiver(DispatchReceiver):
    def __init__(self, config, rank):
        super().__init__(config, rank)
        self.bell = EventDoorbell()
        peers = list(range(self.spec.num_lanes))  # lane writers come first: world rank = lane_id
        self.lanes = LaneReceiver(config, peers, DISPATCH_TAG, self.spec.dispatch_header_words,
                                  self.spec.dispatch_rows, self.bell)
        self._private = private_rows(self.spec, self.spec.lanes_per_region, self.spec.dispatch_rows, config.device)

    def poll(self) -> DispatchMessage | None:
        return self._scan(self.lanes.ready, lambda lane_id, j: self.lanes.take(lane_id, self._private[j]))

    def close(self) -> None:
        self.lanes.close()


class DistCombineSender(CombineSender):
    def __init__(self, config, rank):
        super().__init__(config, rank)
        peers = list(range(self.spec.num_lanes))
        self.lanes = LaneSender(config, peers, COMBINE_TAG, self.spec.combine_header_words,
                                self.spec.segment_rows, self.stats)

    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        self.lanes.write(self.spec.lane_id(region, lane), self.header(payload, layer_id, batch_id), payload)

    def close(self) -> None:
        self.lanes.close()


class DistCombineReceiver(CombineReceiver):
    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        self.bell = EventDoorbell()
        peers = [self.spec.expert_world_rank(e) for e in range(self.spec.num_expert_ranks)]
        self.lanes = LaneReceiver(config, peers, COMBINE_TAG, self.spec.combine_header_words,
                                  self.spec.segment_rows, self.bell)
        self._private = private_rows(self.spec, self.spec.num_expert_ranks, self.spec.segment_rows, config.device)

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        if not all(self.lanes.ready(e) for e in ranks):
            return None
        out = {}
        for e in ranks:
            (layer_id, batch_id, _n), payload = self.lanes.take(e, self._private[e])
            out[e] = CombineSegment(e, self.lanes.consumed[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def close(self) -> None:
        self.lanes.close()


@register
class DistTransport(Transport):
    name = "dist"
    dispatch_sender_cls = DistDispatchSender
    dispatch_receiver_cls = DistDispatchReceiver
    combine_sender_cls = DistCombineSender
    combine_receiver_cls = DistCombineReceiver
