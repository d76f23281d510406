"""P2PTransport: blocking point-to-point over torch.distributed, ASAP 5.4's synchronous baseline.

A send handshakes with its receiver: ``dist.send`` of the header returns only once the receiver
has posted a matching receive (gloo's rendezvous), then the payload follows, also blocking. A
sender to n receivers therefore pays n handshakes in turn, and waits for every receiver that is
busy computing. Receivers block in ``dist.recv`` from any source (``timeout_s`` is ignored).

NOTE: blocking sends need a global order to be deadlock-free. Keep one batch in flight per
lane writer (no dual-batch interleaving) and dispatch to expert ranks in ascending order; this is
the synchronization the one-sided transports remove.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import torch
import torch.distributed as dist

from moeflow.comm.message import CombineMessage, CombineSegment, DispatchMessage, ProtocolError
from moeflow.comm.transport import (CombineReceiver, CombineSender, DispatchReceiver, DispatchSender, Transport,
                                    private_rows, register)

DISPATCH_TAG, COMBINE_TAG = 32, 48  # header; payload uses tag + 1


def _send(dst: int, tag: int, words: list[int], payload: torch.Tensor) -> None:
    dist.send(torch.tensor(words, dtype=torch.int64, device="cpu"), dst, tag=tag)  # the handshake (gloo: host)
    if payload.shape[0]:
        dist.send(payload.contiguous(), dst, tag=tag + 1)


class _Inbox:
    """Receives whole messages from any source into per-lane private buffers (a fresh tensor
    only when a lane already holds an undelivered message), and queues them per lane."""

    def __init__(self, spec, tag: int, header_words: int, num_lanes: int, rows: int, lane_of_rank):
        self.tag, self.lane_of_rank = tag, lane_of_rank
        self.hdr = torch.empty(1 + header_words, dtype=torch.int64, device="cpu")  # [lane_id or rank, *words]
        self.private = private_rows(spec, num_lanes, rows)  # [lanes, rows, H]
        self.pending = [deque() for _ in range(num_lanes)]  # per lane: (words, payload [n, H])
        self.holds_private = [False] * num_lanes

    def receive_one(self) -> None:
        src = dist.recv(self.hdr, None, tag=self.tag)  # blocks: the receiver's side of the handshake
        words = self.hdr.tolist()
        lane, n = self.lane_of_rank(src), words[3]
        if words[0] != lane:
            raise ProtocolError(f"rank {src} sent a message for lane {words[0]}, expected {lane}")
        if self.holds_private[lane]:
            p = self.private
            payload = torch.empty(n, p.shape[2], dtype=p.dtype, device=p.device)  # [n, H]
        else:
            payload, self.holds_private[lane] = self.private[lane, :n], True
        if n:
            dist.recv(payload, src, tag=self.tag + 1)
        self.pending[lane].append((words[1:], payload))

    def pop(self, lane: int):
        words, payload = self.pending[lane].popleft()
        if payload.data_ptr() == self.private[lane].data_ptr() or not self.pending[lane]:
            self.holds_private[lane] = False  # NOTE: the caller's view stays valid until the next recv
        return words, payload


class P2PDispatchSender(DispatchSender):
    def send(self, rank, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        t0 = time.perf_counter()
        words = [self.lane_id, *self.header(payload, layer_id, batch_id, tokens_per_expert)]
        _send(self.spec.expert_world_rank(rank), DISPATCH_TAG, words, payload)
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0


class P2PDispatchReceiver(DispatchReceiver):
    def __init__(self, config, rank):
        super().__init__(config, rank)
        self._inbox = _Inbox(self.spec, DISPATCH_TAG, self.spec.dispatch_header_words,
                             self.spec.num_lanes, self.spec.dispatch_rows, lambda src: src)

    def poll(self) -> DispatchMessage | None:
        """A region already received in full, else None (no network traffic)."""
        return self._scan(lambda lane_id: self._inbox.pending[lane_id], lambda lane_id, _: self._inbox.pop(lane_id))

    def recv(self, timeout_s=None) -> DispatchMessage:
        while (msg := self.poll()) is None:
            self._inbox.receive_one()
        return msg


class P2PCombineSender(CombineSender):
    def send(self, region, lane, payload, layer_id, batch_id) -> None:
        t0 = time.perf_counter()
        words = [self.rank, *self.header(payload, layer_id, batch_id)]
        _send(self.spec.lane_id(region, lane), COMBINE_TAG, words, payload)
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0


class P2PCombineReceiver(CombineReceiver):
    def __init__(self, config, region, lane):
        super().__init__(config, region, lane)
        first = self.spec.num_lanes
        self._inbox = _Inbox(self.spec, COMBINE_TAG, self.spec.combine_header_words,
                             self.spec.num_expert_ranks, self.spec.segment_rows, lambda src: src - first)
        self._seq = [0] * self.spec.num_expert_ranks

    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        if not all(self._inbox.pending[e] for e in ranks):
            return None
        out = {}
        for e in ranks:
            (layer_id, batch_id, _n), payload = self._inbox.pop(e)
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def recv(self, ranks, timeout_s=None) -> CombineMessage:
        ranks = list(ranks)
        # Any source, in arrival order: waiting on the ranks in a fixed order could deadlock
        # against an expert rank that is blocked replying to another lane writer first.
        while (msg := self.poll(ranks)) is None:
            self._inbox.receive_one()
        return msg


@register
class P2PTransport(Transport):
    name = "p2p"
    dispatch_sender_cls = P2PDispatchSender
    dispatch_receiver_cls = P2PDispatchReceiver
    combine_sender_cls = P2PCombineSender
    combine_receiver_cls = P2PCombineReceiver
