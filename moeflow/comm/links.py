"""LinksTransport: per link, shared memory within a host and torch.distributed between hosts.

A deployment that spans hosts names the host of every world rank (``CommConfig.rank_nodes``).
Each endpoint splits its peers by host: a sender writes a peer on its own host through that
peer's shm mailbox (``shm.py``) and a peer elsewhere through gloo (``dist.py``'s lanes); a
receiver owns its mailbox as on one host and pre-posts gloo receives for its remote lanes only,
and a region (or a set of segments) is complete when every lane is, whichever way it came. The
completion threads of the gloo lanes ring the mailbox's doorbell, so one wait covers both.

Same contract as every transport (``transport.py``). Closing follows dist's rule: every process
closes its senders before its receivers.

NOTE: a mailbox keeps its lanes for every writer, remote ones included (unused there): the
layout stays the one-host layout, at the cost of that memory.
"""
from __future__ import annotations

from typing import Sequence

from moeflow.comm.dist import COMBINE_TAG, DISPATCH_TAG, LaneReceiver, LaneSender
from moeflow.comm.mailbox import Mailbox
from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage
from moeflow.comm.remote_weights import LinksWeightStore
from moeflow.comm.shm import (LaneReader, LaneWriter, combine_layout, combine_path, dispatch_layout, dispatch_path,
                              is_ready)
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    private_rows, register)


def split_peers(config, me: int, peers: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """``peers`` (world ranks, by the caller's index) split into those on ``me``'s host and the
    others: two maps caller's index -> position in that list."""
    nodes = config.rank_nodes or (0,) * config.spec.world_size
    local = [i for i, p in enumerate(peers) if nodes[p] == nodes[me]]
    remote = [i for i, p in enumerate(peers) if nodes[p] != nodes[me]]
    return {i: k for k, i in enumerate(local)}, {i: k for k, i in enumerate(remote)}


class _Inbox:
    """A receiver's lanes: its mailbox for the local ones, pre-posted gloo receives for the others."""

    def __init__(self, config, mailbox: Mailbox, me: int, peers: list[int], tag: int, header_words: int, rows: int):
        self.mailbox, self.reader, self.num_slots = mailbox, LaneReader(mailbox), config.spec.num_slots
        _, self.remote = split_peers(config, me, peers)
        remote_ranks = [peers[i] for i in self.remote]
        self.lanes = (LaneReceiver(config, remote_ranks, tag, header_words, rows, mailbox.bell)
                      if remote_ranks else None)
        self.expect = [1] * len(peers)  # next seq of each local lane

    def ready(self, lane: int) -> bool:
        if lane in self.remote:
            return self.lanes.ready(self.remote[lane])
        seq = self.expect[lane]
        return is_ready(self.mailbox, lane, seq % self.num_slots, seq)

    def take(self, lane: int, out):
        if lane in self.remote:
            return self.lanes.take(self.remote[lane], out)
        seq = self.expect[lane]
        words, payload = self.reader.take(lane, seq, out)
        self.mailbox.clear_flag(lane, seq % self.num_slots)  # after the copy: the writer may write again
        self.expect[lane] = seq + 1
        return words, payload

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        self.mailbox.close()


class _Outbox:
    """A sender's lanes: peers' mailboxes on this host, gloo lanes to the others."""

    def __init__(self, config, me: int, peers: list[int], paths: list[str], layout, lane: int, tag: int,
                 header_words: int, rows: int, stats):
        self.local, self.remote = split_peers(config, me, peers)
        boxes = [Mailbox.attach(paths[i], layout, config.attach_timeout_s) for i in self.local]
        self.writer = LaneWriter(boxes, lane, config, stats)
        remote_ranks = [peers[i] for i in self.remote]
        self.lanes = LaneSender(config, remote_ranks, tag, header_words, rows, stats) if remote_ranks else None

    def write(self, dst: int, words: list[int], payload) -> None:
        if dst in self.local:
            self.writer.write(self.local[dst], words, payload)
        else:
            self.lanes.write(self.remote[dst], words, payload)

    def close(self) -> None:
        self.writer.close()
        if self.lanes is not None:
            self.lanes.close()


class LinksDispatchSender(DispatchSender):
    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        s = self.spec
        self.out = _Outbox(config, self.lane_id, [s.expert_world_rank(e) for e in range(s.num_expert_ranks)],
                           [dispatch_path(config.deployment_id, e) for e in range(s.num_expert_ranks)],
                           dispatch_layout(s), self.lane_id, DISPATCH_TAG, s.dispatch_header_words, s.dispatch_rows,
                           self.stats)

    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        self.out.write(rank, self.header(payload, layer_id, batch_id, tokens_per_expert), payload)

    def close(self) -> None:
        self.out.close()


class LinksDispatchReceiver(DispatchReceiver):
    def __init__(self, config, rank):
        super().__init__(config, rank)
        s = self.spec
        mailbox = Mailbox.create(dispatch_path(config.deployment_id, rank), dispatch_layout(s))
        self.bell = mailbox.bell
        self.inbox = _Inbox(config, mailbox, s.expert_world_rank(rank), list(range(s.num_lanes)), DISPATCH_TAG,
                            s.dispatch_header_words, s.dispatch_rows)  # lane writers' world ranks = lane ids
        self._private = private_rows(s, s.lanes_per_region, s.dispatch_rows, config.compute_device)  # [W, rows, H]

    def poll(self) -> DispatchMessage | None:
        return self._scan(self.inbox.ready, lambda lane_id, j: self.inbox.take(lane_id, self._private[j]))

    def close(self) -> None:
        self.inbox.close()


class LinksCombineSender(CombineSender):
    def __init__(self, config, rank):
        super().__init__(config, rank)
        s = self.spec
        self.out = _Outbox(config, s.expert_world_rank(rank), list(range(s.num_lanes)),
                           [combine_path(config.deployment_id, i) for i in range(s.num_lanes)], combine_layout(s),
                           rank, COMBINE_TAG, s.combine_header_words, s.segment_rows, self.stats)

    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        self.out.write(self.spec.lane_id(region, lane), self.header(payload, layer_id, batch_id), payload)

    def close(self) -> None:
        self.out.close()


class LinksCombineReceiver(CombineReceiver):
    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        s = self.spec
        mailbox = Mailbox.create(combine_path(config.deployment_id, self.lane_id), combine_layout(s))
        self.bell = mailbox.bell
        self.inbox = _Inbox(config, mailbox, self.lane_id, [s.expert_world_rank(e) for e in range(s.num_expert_ranks)],
                            COMBINE_TAG, s.combine_header_words, s.segment_rows)
        self._private = private_rows(s, s.num_expert_ranks, s.segment_rows, config.compute_device)  # [E, rows, H]
        self._seq = [0] * s.num_expert_ranks

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        if not all(self.inbox.ready(e) for e in ranks):
            return None
        out = {}
        for e in ranks:
            (layer_id, batch_id, _n), payload = self.inbox.take(e, self._private[e])
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def close(self) -> None:
        self.inbox.close()


@register
class LinksTransport(Transport):
    name = "links"
    dispatch_sender_cls = LinksDispatchSender
    dispatch_receiver_cls = LinksDispatchReceiver
    combine_sender_cls = LinksCombineSender
    combine_receiver_cls = LinksCombineReceiver
    weight_store_cls = LinksWeightStore  # dwdp's pulls, EPLB's moves: shm on this host, a weight server elsewhere

    @classmethod
    def mailbox_bytes(cls, config, node: int = 0) -> int:
        s = config.spec  # the mailboxes of the receivers on this host, each with every writer's lanes
        if s is None:
            return 0
        nodes = config.rank_nodes or (0,) * s.world_size
        experts = sum(nodes[s.expert_world_rank(e)] == node for e in range(s.num_expert_ranks))
        lanes = sum(nodes[i] == node for i in range(s.num_lanes))
        return experts * dispatch_layout(s).size_bytes + lanes * combine_layout(s).size_bytes
