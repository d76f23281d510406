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

from moeflow.comm.dist import COMBINE_TAG, DISPATCH_TAG
from moeflow.comm.lanes import LaneReceiver, LaneSender
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
    """A receiver's lanes: its mailbox for the local ones, gloo receives for the others (``link_of``:
    how to reach a remote peer, None: the world; ``lazy``: a remote lane opens at ``open``)."""

    def __init__(self, config, mailbox: Mailbox, me: int, peers: list[int], tag: int, header_words: int, rows: int,
                 link_of=None, lazy: bool = False):
        self.mailbox, self.reader, self.num_slots = mailbox, LaneReader(mailbox), config.spec.num_slots
        _, self.remote = split_peers(config, me, peers)
        remote_ranks = [peers[i] for i in self.remote]
        self.lanes = (LaneReceiver(config, remote_ranks, tag, header_words, rows, mailbox.bell, link_of, lazy)
                      if remote_ranks else None)
        self.expect = [1] * len(peers)  # next seq of each local lane

    def open(self, lane: int) -> None:
        if lane in self.remote:
            self.lanes.open(self.remote[lane])

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

    def forget(self, lane: int) -> None:
        """Lane ``lane``'s writer left: one that joins in its place writes from seq 1."""
        if lane in self.remote:
            self.lanes.drop(self.remote[lane])
        else:
            self.expect[lane], self.reader.streamed[lane] = 1, 0
            self.mailbox.reset_lane(lane)

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        self.mailbox.close()


class _Outbox:
    """A sender's lanes: peers' mailboxes on this host (attached at the first write to each), gloo
    lanes to the others (``link_of``: how to reach one, None: the world)."""

    def __init__(self, config, me: int, peers: list[int], paths: list[str], layout, lane: int, tag: int,
                 header_words: int, rows: int, stats, link_of=None):
        self.local, self.remote = split_peers(config, me, peers)
        local_paths = [paths[i] for i in sorted(self.local, key=self.local.get)]
        self.writer = LaneWriter([None] * len(local_paths), lane, config, stats,
                                 lambda k: Mailbox.attach(local_paths[k], layout, config.attach_timeout_s))
        remote_ranks = [peers[i] for i in self.remote]
        self.lanes = LaneSender(config, remote_ranks, tag, header_words, rows, stats, link_of) if remote_ranks else None

    def write(self, dst: int, words: list[int], payload) -> None:
        if dst in self.local:
            self.writer.write(self.local[dst], words, payload)
        else:
            self.lanes.write(self.remote[dst], words, payload)

    def detach(self, dst: int) -> None:
        """``dst`` left: say goodbye (its receives end), and one that joins in its place starts afresh."""
        if dst in self.local:
            self.writer.detach(self.local[dst])
        else:
            self.lanes.goodbye(self.remote[dst])

    def close(self) -> None:
        self.writer.close()
        if self.lanes is not None:
            self.lanes.close()


def world_links(config, me: int):
    """How an endpoint of ``links`` reaches a peer on another host: a rank of the world (None)."""
    return None


class LinksDispatchSender(DispatchSender):
    link_of = staticmethod(world_links)

    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        s = self.spec
        self.out = _Outbox(config, self.lane_id, [s.expert_world_rank(e) for e in range(s.num_expert_ranks)],
                           [dispatch_path(config.deployment_id, e) for e in range(s.num_expert_ranks)],
                           dispatch_layout(s), self.lane_id, DISPATCH_TAG, s.dispatch_header_words, s.dispatch_rows,
                           self.stats, self.link_of(config, self.lane_id))

    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        self.out.write(rank, self.header(payload, layer_id, batch_id, tokens_per_expert), payload)

    def detach(self, rank: int) -> None:
        self.out.detach(rank)

    def close(self) -> None:
        self.out.close()


class LinksDispatchReceiver(DispatchReceiver):
    link_of = staticmethod(world_links)

    def __init__(self, config, rank):
        super().__init__(config, rank)
        s = self.spec
        mailbox = Mailbox.create(dispatch_path(config.deployment_id, rank), dispatch_layout(s))
        self.bell = mailbox.bell
        me = s.expert_world_rank(rank)  # lane writers' world ranks = lane ids
        self.inbox = _Inbox(config, mailbox, me, list(range(s.num_lanes)), DISPATCH_TAG, s.dispatch_header_words,
                            s.dispatch_rows, self.link_of(config, me))
        self._private = private_rows(s, s.lanes_per_region, s.dispatch_rows, config.compute_device)  # [W, rows, H]

    def poll(self) -> DispatchMessage | None:
        return self._scan(self.inbox.ready, lambda lane_id, j: self.inbox.take(lane_id, self._private[j]))

    def close(self) -> None:
        self.inbox.close()


class LinksCombineSender(CombineSender):
    link_of = staticmethod(world_links)

    def __init__(self, config, rank):
        super().__init__(config, rank)
        s = self.spec
        me = s.expert_world_rank(rank)
        self.out = _Outbox(config, me, list(range(s.num_lanes)),
                           [combine_path(config.deployment_id, i) for i in range(s.num_lanes)], combine_layout(s),
                           rank, COMBINE_TAG, s.combine_header_words, s.segment_rows, self.stats,
                           self.link_of(config, me))

    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        self.out.write(self.spec.lane_id(region, lane), self.header(payload, layer_id, batch_id), payload)

    def close(self) -> None:
        self.out.close()


class LinksCombineReceiver(CombineReceiver):
    link_of = staticmethod(world_links)

    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        s = self.spec
        mailbox = Mailbox.create(combine_path(config.deployment_id, self.lane_id), combine_layout(s))
        self.bell = mailbox.bell
        link_of = self.link_of(config, self.lane_id)
        # NOTE: with links of their own, a remote expert rank's lane opens when it is first polled: an
        # elastic deployment's expert ranks may join later (and one that left, at its index again)
        self.inbox = _Inbox(config, mailbox, self.lane_id, [s.expert_world_rank(e) for e in range(s.num_expert_ranks)],
                            COMBINE_TAG, s.combine_header_words, s.segment_rows, link_of, lazy=link_of is not None)
        self._private = private_rows(s, s.num_expert_ranks, s.segment_rows, config.compute_device)  # [E, rows, H]
        self._seq = [0] * s.num_expert_ranks

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        for e in ranks:
            self.inbox.open(e)
        if not all(self.inbox.ready(e) for e in ranks):
            return None
        out = {}
        for e in ranks:
            (layer_id, batch_id, _n), payload = self.inbox.take(e, self._private[e])
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def forget(self, rank: int) -> None:
        self.inbox.forget(rank)
        self._seq[rank] = 0

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
