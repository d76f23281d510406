"""DistTransport: the same primitives across hosts, over torch.distributed isend/irecv.

The receiver plays the shared buffer's part with pre-posted receives: every lane has ``num_slots``
private receive buffers with an ``irecv`` posted on each, so a sender's ``isend`` lands without the
receiver's involvement, and the send returns after staging its copy (pinned when the payloads are
a GPU's). A message is one uint8 tensor: header [seq, *words] int64 (padded to 64 B), then the
payload bytes; gloo accepts a receive buffer larger than the message, so slots are posted whole.

Message ``seq`` of a lane uses slot ``seq % num_slots`` and tag ``base + slot`` on both sides. A
sender reuses a staging slot once its previous isend completed (else it waits: backpressure);
a receiver re-posts a slot once it copied the message out.

A lane from a process to itself (dep's ``shared_ranks``: a rank and its experts) is a
``Loopback`` in process memory: gloo cannot send to its own rank.

NOTE: gloo marks a work completed only for a thread that waits on it (``get_future`` is not
implemented), so one ``Completer`` thread per peer waits on that peer's works in order and counts
them, the GIL released. With NCCL (``device="cuda"``, untested: no two GPUs here) ``wait()`` only
orders a stream, so the thread also synchronizes it.

The process group is the caller's: ``dist.init_process_group`` before, destroy after closing.
Closing is collective: every process closes its senders (each fills its peers' pre-posted
receives with goodbye headers: no thread waits on a receive that never comes), then its
receivers (which wait for those goodbyes), then destroys the group.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import torch
import torch.distributed as dist

from moeflow.comm.doorbell import Doorbell, EventDoorbell
from moeflow.comm.loopback import loopback
from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage, ProtocolError, SendStats
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    private_rows, register)
from moeflow.comm.wait import POLICIES, wait_for

DISPATCH_TAG, COMBINE_TAG = 0, 16  # + slot


class Completer:
    """Waits on one peer's works, in posting order, in a daemon thread; ``done`` counts them."""

    def __init__(self, bell: Doorbell | None, device: str = "cpu"):
        self.bell, self.done, self.error, self.is_cuda = bell, 0, None, device.startswith("cuda")
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def post(self, work) -> None:
        self._q.put(work)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"torch.distributed transfer failed: {self.error}") from self.error

    def _run(self) -> None:
        while (work := self._q.get()) is not None:
            try:
                work.wait()
                if self.is_cuda:
                    torch.cuda.current_stream().synchronize()
            except Exception as e:  # a peer died or the group was destroyed
                self.error = e
                return
            self.done += 1  # only this thread writes it; readers see whole ints under the GIL
            if self.bell is not None:
                self.bell.ring()

    def close(self, join_s: float = 5.0) -> None:
        # joined: a thread inside gloo at group destruction aborts the exit (a stuck receive stays: no cancel)
        self._q.put(None)
        self._thread.join(join_s)


def _header_bytes(header_words: int) -> int:
    return (8 * (1 + header_words) + 63) // 64 * 64


def _staging(config, size: int) -> torch.Tensor:  # pinned when gloo carries a GPU's payloads: one DMA each
    return torch.empty(size, dtype=torch.uint8, device=config.device,
                       pin_memory=config.device == "cpu" and config.compute_device.startswith("cuda"))


class LaneSender:
    """One lane's messages to several peers: staging slots and isends per peer."""

    def __init__(self, config, peers: list[int], tag: int, header_words: int, rows: int, stats: SendStats):
        spec = config.spec
        self.peers, self.tag, self.policy, self.stats = peers, tag, config.wait, stats
        self.num_slots, self.hidden, self.dtype = spec.num_slots, spec.hidden_size, getattr(torch, spec.dtype)
        self.row_bytes = spec.hidden_size * spec.dtype_bytes
        self.hdr_bytes = _header_bytes(header_words)
        size = self.hdr_bytes + rows * spec.hidden_size * spec.dtype_bytes
        self.staging = [[_staging(config, size) for _ in range(spec.num_slots)] for _ in peers]  # [peer][slot]
        self.bell = EventDoorbell()
        self.completers = [Completer(self.bell, config.device) for _ in peers]
        self.seq = [0] * len(peers)
        me = dist.get_rank()
        self.loops = {dst: loopback(tag) for dst, p in enumerate(peers) if p == me}  # lanes to ourselves

    def write(self, dst: int, words: list[int], payload: torch.Tensor) -> None:
        t0 = time.perf_counter()
        seq = self.seq[dst] + 1
        if dst in self.loops:
            self.loops[dst].put(seq, words, payload)
            self.seq[dst] = seq
            self.stats.num_sends += 1
            self.stats.blocked_s += time.perf_counter() - t0
            return
        slot, c = seq % self.num_slots, self.completers[dst]
        c.check()
        if c.done < seq - self.num_slots:  # the slot's previous isend is still in flight
            self.stats.num_backpressure += 1
            wait_for(lambda: True if c.done >= seq - self.num_slots or c.error else None, self.bell, self.policy)
            c.check()
            self.stats.backpressure_s += time.perf_counter() - t0
        elif c.done < seq - 1:
            self.stats.num_overlapped += 1
        buf, n = self.staging[dst][slot], payload.shape[0]
        header = torch.tensor([seq, *words], dtype=torch.int64, device=buf.device)
        buf[:8 * (1 + len(words))].view(torch.int64).copy_(header)
        end = self.hdr_bytes + n * self.row_bytes
        if n:
            buf[self.hdr_bytes:end].view(self.dtype).view(n, self.hidden).copy_(payload)
        c.post(dist.isend(buf[:end], self.peers[dst], tag=self.tag + slot))
        self.seq[dst] = seq
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0

    def close(self, timeout_s: float = 30.0) -> None:
        """Say goodbye: fill each peer's ``num_slots`` pre-posted receives with a closing header
        (seq < 0), so no thread there is left waiting on a receive that never comes; wait until
        every isend completed, then stop the threads."""
        for dst, c in enumerate(self.completers):
            if dst in self.loops:
                c.close()
                continue
            for k in range(1, self.num_slots + 1):
                seq = self.seq[dst] + k
                # NOTE: a buffer of its own: the staging slot may still be in flight.
                bye = torch.full((self.hdr_bytes // 8,), -seq, dtype=torch.int64, device=self.staging[dst][0].device)
                c.post(dist.isend(bye, self.peers[dst], tag=self.tag + seq % self.num_slots))
            total = self.seq[dst] + self.num_slots
            wait_for(lambda: True if c.done >= total or c.error else None, self.bell, self.policy, timeout_s)
            c.close()


class LaneReceiver:
    """Pre-posted receives for several lanes (one peer each), ``num_slots`` per lane."""

    def __init__(self, config, peers: list[int], tag: int, header_words: int, rows: int, bell: Doorbell):
        spec = config.spec
        self.peers, self.tag, self.num_slots = peers, tag, spec.num_slots
        self.hidden, self.dtype, self.header_words = spec.hidden_size, getattr(torch, spec.dtype), header_words
        self.row_bytes = spec.hidden_size * spec.dtype_bytes
        self.hdr_bytes = _header_bytes(header_words)
        size = self.hdr_bytes + rows * spec.hidden_size * spec.dtype_bytes
        self.bufs = [[_staging(config, size) for _ in range(spec.num_slots)] for _ in peers]  # [lane][slot]
        self.completers = [Completer(bell, config.device) for _ in peers]
        self.consumed = [0] * len(peers)
        self.closed = [False] * len(peers)
        me = dist.get_rank()
        self.loops = {lane: loopback(tag) for lane, p in enumerate(peers) if p == me}  # lanes from ourselves
        for loop in self.loops.values():
            loop.bell = bell
        for lane in range(len(peers)):
            for seq in range(1, self.num_slots + 1 if lane not in self.loops else 1):
                self._post(lane, seq % self.num_slots)  # in seq order: the completer waits in order

    def _post(self, lane: int, slot: int) -> None:
        self.completers[lane].post(dist.irecv(self.bufs[lane][slot], self.peers[lane], tag=self.tag + slot))

    def ready(self, lane: int) -> bool:
        if lane in self.loops:
            return bool(self.loops[lane].queue)
        c = self.completers[lane]
        c.check()
        if c.done <= self.consumed[lane] or self.closed[lane]:
            return False
        seq = self.consumed[lane] + 1
        if int(self.bufs[lane][seq % self.num_slots][:8].view(torch.int64)[0]) < 0:
            self.closed[lane] = True  # its sender said goodbye: nothing more will come
            return False
        return True

    def take(self, lane: int, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Copy the lane's next message out: (header words, payload view of ``out`` [n, H]); re-post."""
        seq = self.consumed[lane] + 1
        if lane in self.loops:
            self.consumed[lane] = seq
            return self.loops[lane].take(seq, out)
        slot = seq % self.num_slots
        buf = self.bufs[lane][slot]
        got_seq, *words = buf[:8 * (1 + self.header_words)].view(torch.int64).tolist()
        if got_seq == -seq:
            raise ProtocolError(f"lane {lane} (rank {self.peers[lane]}) was closed by its sender")
        if got_seq != seq:
            raise ProtocolError(f"lane {lane} (rank {self.peers[lane]}) slot {slot}: seq {got_seq}, expected {seq}")
        n = words[2]
        dst = out[:n]  # [n, H]
        if n:
            end = self.hdr_bytes + n * self.row_bytes
            dst.copy_(buf[self.hdr_bytes:end].view(self.dtype).view(n, self.hidden))
        self.consumed[lane] = seq
        self._post(lane, slot)  # receives message seq + num_slots
        return words, dst

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for every sender's goodbye (see LaneSender.close), then stop the threads. Close the
        senders of this process first: peers wait for their goodbyes as we wait for theirs."""
        bell = EventDoorbell()
        for lane, (c, seen) in enumerate(zip(self.completers, self.consumed)):
            if lane in self.loops:
                c.close()
                continue
            c.bell = bell
            wait_for(lambda: True if c.done >= seen + self.num_slots or c.error else None, bell,
                     POLICIES["block"], timeout_s)
            c.close()


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
