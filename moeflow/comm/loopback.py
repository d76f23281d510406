"""Loopback: a torch.distributed lane whose two ends are one process (dep: a rank dispatching to
its own experts, and getting their results back).

gloo has no pair to its own rank (a send to oneself fails: "Pair is not connected"), so such a
lane never touches the network: the sender copies its message into a queue that the receiver of
the same process reads. Order and exactly-once are those of the queue; there is no backpressure
(a lane writer keeps at most ``num_slots`` batches in flight anyway).
"""
from __future__ import annotations

from collections import deque

import torch

from moeflow.comm.doorbell import Doorbell
from moeflow.comm.message import ProtocolError


class Loopback:
    """The messages of one lane kind (a tag) from this process to itself."""

    def __init__(self):
        self.queue: deque[tuple[int, list[int], torch.Tensor]] = deque()  # (seq, header words, payload [n, H])
        self.bell: Doorbell | None = None  # the receiver's, once it exists

    def put(self, seq: int, words: list[int], payload: torch.Tensor) -> None:
        self.queue.append((seq, words, payload.clone()))
        if self.bell is not None:
            self.bell.ring()

    def take(self, seq: int, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The next message's header words and its payload copied into ``out`` [rows, H] (a view)."""
        got, words, payload = self.queue.popleft()
        if got != seq:
            raise ProtocolError(f"loopback: seq {got}, expected {seq}")
        dst = out[:payload.shape[0]]  # [n, H]
        dst.copy_(payload)
        return words, dst


_LOOPS: dict[int, Loopback] = {}  # tag -> this process's loopback of that lane kind


def loopback(tag: int) -> Loopback:
    return _LOOPS.setdefault(tag, Loopback())
