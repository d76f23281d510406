"""ShmTransport: the one-sided primitives over shared memory on one host (ASAP 3.2).

Every expert rank owns a dispatch mailbox of R x W lanes (region i = lanes i*W .. i*W+W-1, one
per lane writer); every lane writer owns a combine mailbox of E lanes (one segment per expert
rank). See ``mailbox.py`` for the layout, the slot protocol and the memory-ordering argument.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from moeflow.comm.doorbell import NapDoorbell
from moeflow.comm.mailbox import Mailbox, MailboxLayout
from moeflow.comm.message import (CombineMessage, CombineSegment, DispatchMessage, DispatchRow, ProtocolError,
                                  SendStats)
from moeflow.comm.segment import pid_alive, segment_path
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    private_rows, register)
from moeflow.comm.wait import wait_for
from moeflow.comm.weights import ShmWeightStore

_OWNER_CHECK_S = 0.5  # a sender under backpressure checks this often that its reader still lives


def dispatch_layout(spec, arena: str = "host") -> MailboxLayout:
    return MailboxLayout(spec.num_lanes, spec.num_slots, spec.dispatch_header_words,
                         spec.dispatch_rows, spec.hidden_size, spec.dtype, arena)


def combine_layout(spec, arena: str = "host") -> MailboxLayout:
    return MailboxLayout(spec.num_expert_ranks, spec.num_slots, spec.combine_header_words,
                         spec.segment_rows, spec.hidden_size, spec.dtype, arena)


def dispatch_path(deployment_id: str, rank: int) -> str:
    """Expert rank ``rank``'s dispatch buffer."""
    return segment_path(deployment_id, f"dispatch{rank}")


def combine_path(deployment_id: str, lane_id: int) -> str:
    """The combine buffer of lane ``lane_id``'s writer."""
    return segment_path(deployment_id, f"combine{lane_id}")


class LaneWriter:
    """The writing half of the slot protocol, for one lane in each of several mailboxes. With
    ``attach``, a mailbox given as None is attached at its first write (an elastic deployment's
    expert ranks that join later), and ``detach`` lets one go (it left: a rank that joins at its
    index later owns a new mailbox, written from seq 1 again)."""

    def __init__(self, mailboxes: list[Mailbox | None], lane: int, config, stats: SendStats,
                 attach: Callable[[int], Mailbox] | None = None):
        self.mailboxes, self.lane, self.policy, self.stats = mailboxes, lane, config.wait, stats
        self._attach = attach
        self.num_slots = config.spec.num_slots
        row_bytes = config.spec.hidden_size * config.spec.dtype_bytes
        self.chunk_rows = max(1, config.stream_chunk_bytes // row_bytes) if config.stream_chunk_bytes else 0
        self.seq = [0] * len(mailboxes)  # last seq written to each mailbox's lane
        self._nap = NapDoorbell(config.wait.nap_s)

    def write(self, dst: int, words: list[int], payload: torch.Tensor) -> tuple[Mailbox, int]:
        """Write one message to mailbox ``dst``; returns (mailbox, slot) for a caller that waits."""
        t0 = time.perf_counter()
        if self.mailboxes[dst] is None:
            self.mailboxes[dst] = self._attach(dst)
        mb, lane, seq = self.mailboxes[dst], self.lane, self.seq[dst] + 1
        slot = seq % self.num_slots
        held = mb.flag(lane, slot)
        if held != 0:
            if held != seq - self.num_slots:
                raise ProtocolError(f"{mb.segment.path} lane {lane} slot {slot}: flag {held}, expected 0 "
                                    f"or {seq - self.num_slots} (another writer on this lane?)")
            self.stats.num_backpressure += 1
            while wait_for(lambda: True if mb.flag(lane, slot) == 0 else None, self._nap, self.policy,
                           _OWNER_CHECK_S) is None:
                if not pid_alive(mb.owner_pid):
                    raise ConnectionError(f"the reader of {mb.segment.path} (pid {mb.owner_pid}) is gone")
            self.stats.backpressure_s += time.perf_counter() - t0
        elif seq > 1 and mb.flag(lane, (slot - 1) % self.num_slots) != 0:
            self.stats.num_overlapped += 1
        mb.write_header(lane, slot, words)
        n, out = payload.shape[0], mb.payload(lane, slot)
        step = self.chunk_rows or n
        if 0 < n <= step:
            mb.arena.copy_in(out[:n], payload)
        elif n:
            for start in range(0, n, step):  # stream: the reader may copy each chunk as it lands
                end = min(n, start + step)
                mb.arena.copy_in(out[start:end], payload[start:end])
                mb.set_progress(lane, slot, seq, end)
                mb.bell.ring()
        mb.set_flag(lane, slot, seq)  # publishes the message (release point)
        mb.bell.ring()
        self.seq[dst] = seq
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0
        return mb, slot

    def detach(self, dst: int) -> None:
        if self.mailboxes[dst] is not None:
            self.mailboxes[dst].close()
        self.mailboxes[dst], self.seq[dst] = None, 0

    def close(self) -> None:
        for mb in self.mailboxes:
            if mb is not None:
                mb.close()
        self.mailboxes = []


class LaneReader:
    """The reading half: takes complete messages to private memory, and meanwhile copies the
    rows a streaming writer has already published, so that the two copies overlap."""

    def __init__(self, mailbox: Mailbox):
        self.mb, self.num_slots = mailbox, mailbox.layout.num_slots
        self.streamed = [0] * mailbox.layout.num_lanes  # rows of each lane's next message already copied
        self.num_streamed_rows = 0  # rows copied before their message was complete, in total

    def stream(self, lane: int, seq: int, out: torch.Tensor) -> None:
        """Copy whatever more of message ``seq`` has been published into ``out`` [R, H]."""
        slot, done = seq % self.num_slots, self.streamed[lane]
        ready = self.mb.progress(lane, slot, seq)
        if ready > done:
            self.mb.arena.copy_out(out[done:ready], self.mb.payload(lane, slot)[done:ready])
            self.streamed[lane] = ready
            self.num_streamed_rows += ready - done

    def take(self, lane: int, seq: int, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Header words and payload view ``out[:n]`` of the complete message ``seq``. The caller
        clears the flag once every lane it takes together is copied."""
        slot, done = seq % self.num_slots, self.streamed[lane]
        words = self.mb.read_header(lane, slot)
        n = words[2]
        if n > done:
            self.mb.arena.copy_out(out[done:n], self.mb.payload(lane, slot)[done:n])
        self.streamed[lane] = 0
        return words, out[:n]


class ShmDispatchSender(DispatchSender):
    def __init__(self, config, region: int, lane: int):
        super().__init__(config, region, lane)
        layout = dispatch_layout(self.spec, config.arena)
        # NOTE: attached at the first send to each: an elastic deployment's buffers are sized for
        # expert ranks that may join later (the ranks present were all up before anyone sends)
        self.writer = LaneWriter([None] * self.spec.num_expert_ranks, self.lane_id, config, self.stats,
                                 lambda e: Mailbox.attach(dispatch_path(config.deployment_id, e), layout,
                                                          config.attach_timeout_s, config.compute_device))

    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        self.writer.write(rank, self.header(payload, layer_id, batch_id, tokens_per_expert), payload)

    def detach(self, rank: int) -> None:
        self.writer.detach(rank)

    def close(self) -> None:
        self.writer.close()


class ShmDispatchReceiver(DispatchReceiver):
    def __init__(self, config, rank: int):
        super().__init__(config, rank)
        self.mailbox = Mailbox.create(dispatch_path(config.deployment_id, rank),
                                      dispatch_layout(self.spec, config.arena), config.compute_device)
        self.bell = self.mailbox.bell
        self.reader = LaneReader(self.mailbox)
        self._expect = [1] * self.spec.num_regions  # next seq of each region
        self._private: list = [None] * self.spec.num_regions  # per region, on first use: [W, rows, H]

    def poll(self) -> DispatchMessage | None:
        r, w, mb = self.spec.num_regions, self.spec.lanes_per_region, self.mailbox
        for k in range(r):
            i = (self._next_region + k) % r
            seq = self._expect[i]
            slot = seq % self.spec.num_slots
            if all(is_ready(mb, i * w + j, slot, seq) for j in range(w)):
                self._expect[i] = seq + 1
                self._next_region = (i + 1) % r
                return self._take(i, seq, slot)
        for i in range(r):  # nothing complete: copy what is being written meanwhile
            for j in range(w):
                self.reader.stream(i * w + j, self._expect[i], self._region_private(i)[j])
        return None

    def forget_region(self, region: int) -> None:
        w = self.spec.lanes_per_region
        for j in range(w):
            self.reader.streamed[region * w + j] = 0
            self.mailbox.reset_lane(region * w + j)
        self._expect[region] = 1

    def _region_private(self, region: int) -> torch.Tensor:
        if self._private[region] is None:
            self._private[region] = private_rows(self.spec, self.spec.lanes_per_region, self.spec.dispatch_rows,
                                                 self.config.compute_device)
        return self._private[region]

    def _take(self, region: int, seq: int, slot: int) -> DispatchMessage:
        w, mb, private = self.spec.lanes_per_region, self.mailbox, self._region_private(region)
        rows = []
        for j in range(w):
            (layer_id, batch_id, _n, *tpe), payload = self.reader.take(region * w + j, seq, private[j])
            rows.append(DispatchRow(j, layer_id, batch_id, tpe, payload))
        for j in range(w):
            mb.clear_flag(region * w + j, slot)  # after every copy: the senders may write again
        if any((r.layer_id, r.batch_id) != (rows[0].layer_id, rows[0].batch_id) for r in rows):
            raise ProtocolError(f"region {region} seq {seq}: rows disagree on (layer, batch): "
                                f"{[(r.layer_id, r.batch_id) for r in rows]}")
        return DispatchMessage(region, seq, rows)

    def close(self) -> None:
        self.mailbox.close()


class ShmCombineSender(CombineSender):
    def __init__(self, config, rank: int):
        super().__init__(config, rank)
        layout = combine_layout(self.spec, config.arena)
        # NOTE: attached at the first reply to each: an elastic deployment's buffers are sized for
        # attention groups that may join later (those present were all up before anyone dispatches)
        self.writer = LaneWriter([None] * self.spec.num_lanes, rank, config, self.stats,
                                 lambda i: Mailbox.attach(combine_path(config.deployment_id, i), layout,
                                                          config.attach_timeout_s, config.compute_device))

    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        self.writer.write(self.spec.lane_id(region, lane), self.header(payload, layer_id, batch_id), payload)

    def detach_region(self, region: int) -> None:
        for lane in range(self.spec.lanes_per_region):
            self.writer.detach(self.spec.lane_id(region, lane))

    def close(self) -> None:
        self.writer.close()


class ShmCombineReceiver(CombineReceiver):
    def __init__(self, config, region: int, lane: int):
        super().__init__(config, region, lane)
        self.mailbox = Mailbox.create(combine_path(config.deployment_id, self.lane_id),
                                      combine_layout(self.spec, config.arena), config.compute_device)
        self.bell = self.mailbox.bell
        self.reader = LaneReader(self.mailbox)
        self._expect = [1] * self.spec.num_expert_ranks  # next seq of each segment
        self._private = private_rows(self.spec, self.spec.num_expert_ranks, self.spec.segment_rows,
                                     config.compute_device)  # [E, rows, H]

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        mb, s = self.mailbox, self.spec.num_slots
        if not all(is_ready(mb, e, self._expect[e] % s, self._expect[e]) for e in ranks):
            for e in ranks:  # copy what is being written meanwhile
                self.reader.stream(e, self._expect[e], self._private[e])
            return None
        segments = {}
        for e in ranks:
            seq = self._expect[e]
            (layer_id, batch_id, _n), payload = self.reader.take(e, seq, self._private[e])
            mb.clear_flag(e, seq % s)
            self._expect[e] = seq + 1
            segments[e] = CombineSegment(e, seq, layer_id, batch_id, payload)
        return CombineMessage(segments)

    def forget(self, rank: int) -> None:
        self._expect[rank], self.reader.streamed[rank] = 1, 0
        self.mailbox.reset_lane(rank)

    def close(self) -> None:
        self.mailbox.close()


def is_ready(mb: Mailbox, lane: int, slot: int, seq: int) -> bool:
    flag = mb.flag(lane, slot)  # NOTE: the acquire point: header and payload are read after this
    if flag == seq:
        return True
    if flag != 0:
        raise ProtocolError(f"{mb.segment.path} lane {lane} slot {slot}: flag {flag}, expected 0 or {seq}")
    return False


@register
class ShmTransport(Transport):
    name = "shm"
    dispatch_sender_cls = ShmDispatchSender
    dispatch_receiver_cls = ShmDispatchReceiver
    combine_sender_cls = ShmCombineSender
    combine_receiver_cls = ShmCombineReceiver
    weight_store_cls = ShmWeightStore

    @classmethod
    def mailbox_bytes(cls, config, node: int = 0) -> int:
        s = config.spec  # one host: every expert rank's dispatch mailbox, every lane writer's combine one
        return 0 if s is None else (s.num_expert_ranks * dispatch_layout(s, config.arena).size_bytes +
                                    s.num_lanes * combine_layout(s, config.arena).size_bytes)
