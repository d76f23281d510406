"""P2PTransport: blocking point-to-point over torch.distributed, ASAP 5.4's synchronous baseline.

A send handshakes with its receiver: ``dist.send`` of the header returns only once the receiver
has posted a matching receive (gloo's rendezvous), then the payload follows, also blocking. A
sender to n receivers therefore pays n handshakes in turn, and waits for every receiver that is
busy computing. Receivers block in ``dist.recv`` from any source (``timeout_s`` is ignored).

NOTE: blocking sends need a global order to be deadlock-free. Keep one batch in flight per
attention rank (no dual-batch interleaving) and dispatch to workers in ascending order; this is
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
    dist.send(torch.tensor(words, dtype=torch.int64), dst, tag=tag)  # the handshake
    if payload.shape[0]:
        dist.send(payload.contiguous(), dst, tag=tag + 1)


class _Inbox:
    """Receives whole messages from any source into per-lane private buffers (a fresh tensor
    only when a lane already holds an undelivered message), and queues them per lane."""

    def __init__(self, spec, tag: int, header_words: int, num_lanes: int, rows: int, lane_of_rank):
        self.tag, self.lane_of_rank = tag, lane_of_rank
        self.hdr = torch.empty(1 + header_words, dtype=torch.int64)  # [lane or worker, *words]
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
            payload = torch.empty(n, self.private.shape[2], dtype=self.private.dtype)  # [n, H]
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
    def send(self, worker, payload, layer_id, batch_id, tokens_per_expert=None) -> None:
        t0 = time.perf_counter()
        words = [self.lane, *self.header(payload, layer_id, batch_id, tokens_per_expert)]
        _send(self.spec.moe_rank(worker), DISPATCH_TAG, words, payload)
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0


class P2PDispatchReceiver(DispatchReceiver):
    def __init__(self, config, worker):
        super().__init__(config, worker)
        self._inbox = _Inbox(self.spec, DISPATCH_TAG, self.spec.dispatch_header_words,
                             self.spec.num_attention_ranks, self.spec.dispatch_rows, lambda rank: rank)

    def poll(self) -> DispatchMessage | None:
        """A region already received in full, else None (no network traffic)."""
        return self._scan(lambda lane: self._inbox.pending[lane], lambda lane, j: self._inbox.pop(lane))

    def recv(self, timeout_s=None) -> DispatchMessage:
        while (msg := self.poll()) is None:
            self._inbox.receive_one()
        return msg


class P2PCombineSender(CombineSender):
    def send(self, group, member, payload, layer_id, batch_id) -> None:
        t0 = time.perf_counter()
        words = [self.worker, *self.header(payload, layer_id, batch_id)]
        _send(self.spec.attention_rank(group, member), COMBINE_TAG, words, payload)
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0


class P2PCombineReceiver(CombineReceiver):
    def __init__(self, config, group, member):
        super().__init__(config, group, member)
        first = self.spec.num_attention_ranks
        self._inbox = _Inbox(self.spec, COMBINE_TAG, self.spec.combine_header_words,
                             self.spec.num_moe_workers, self.spec.segment_rows, lambda rank: rank - first)
        self._seq = [0] * self.spec.num_moe_workers

    def poll(self, workers: Sequence[int]) -> CombineMessage | None:
        if not all(self._inbox.pending[e] for e in workers):
            return None
        out = {}
        for e in workers:
            (layer_id, batch_id, _n), payload = self._inbox.pop(e)
            self._seq[e] += 1
            out[e] = CombineSegment(e, self._seq[e], layer_id, batch_id, payload)
        return CombineMessage(out)

    def recv(self, workers, timeout_s=None) -> CombineMessage:
        workers = list(workers)
        # Any source, in arrival order: waiting on the workers in a fixed order could deadlock
        # against a worker that is blocked replying to another rank first.
        while (msg := self.poll(workers)) is None:
            self._inbox.receive_one()
        return msg


@register
class P2PTransport(Transport):
    name = "p2p"
    dispatch_sender_cls = P2PDispatchSender
    dispatch_receiver_cls = P2PDispatchReceiver
    combine_sender_cls = P2PCombineSender
    combine_receiver_cls = P2PCombineReceiver
