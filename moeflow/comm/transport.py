"""The four primitives as base classes, and the registry of transports that implement them.

    attention rank (group i, member j)                       MoE worker e
    DispatchSender.send(e, x, layer, batch, tpe)  ------->   DispatchReceiver.recv() -> DispatchMessage
    CombineReceiver.recv([e, ...]) -> CombineMessage  <---   CombineSender.send(i, j, y, layer, batch)

Legend: n token rows, H hidden size, Epw experts per MoE worker. Every payload is [n, H] of the
spec's dtype, 0 <= n <= the slot capacity (``spec.dispatch_rows`` / ``spec.segment_rows``).

Contract shared by every transport:
- A send returns once the payload is out of the caller's tensor: in the receiver's shared
  buffer (shm), in a staging slot handed to isend (dist), or taken by the receiver (the
  blocking baselines p2p and shm-handshake). The caller may reuse its tensor at once.
- Messages of one lane (one sender to one receiver) arrive in order, each exactly once.
- A one-sided send waits only when its slot still holds an unread message (backpressure, in
  ``stats``). An attention rank keeps at most ``num_slots`` batches in flight, which makes
  the dispatch/combine cycle deadlock-free: a reply always finds its slot free.
- Returned payloads are views of the receiver's private staging memory, valid until that
  receiver's next recv; clone them to keep them longer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Sequence

import torch

from moeflow.comm.doorbell import Doorbell, NapDoorbell
from moeflow.comm.message import CombineMessage, DispatchMessage, DispatchRow, SendStats
from moeflow.comm.wait import wait_for


class DispatchSender(ABC):
    """async-dispatch-send, for TP member ``member`` of DP group ``group`` (its lane in every
    MoE worker's buffer is ``group * T + member``)."""

    def __init__(self, config, group: int, member: int):
        self.config, self.spec = config, config.spec
        self.group, self.member = group, member
        self.lane = config.spec.attention_rank(group, member)
        self.stats = SendStats()

    @abstractmethod
    def send(self, worker: int, payload: torch.Tensor, layer_id: int, batch_id: int,
             tokens_per_expert: Sequence[int] | None = None) -> None:
        """Write ``payload`` [n, H] (rows grouped by local expert) into MoE worker ``worker``'s
        buffer. ``tokens_per_expert`` [Epw]: rows per local expert, summing to n (may be None
        when Epw == 1). All T members of a group send to the same workers in the same order,
        n = 0 included: the receiver waits for all T rows of a region."""

    def close(self) -> None:
        pass

    def header(self, payload: torch.Tensor, layer_id: int, batch_id: int,
               tokens_per_expert: Sequence[int] | None) -> list[int]:
        """Validated header words: layer id, batch id, n, tokens per local expert [Epw]."""
        n = check_payload(payload, self.spec, self.spec.dispatch_rows)
        epw = self.spec.experts_per_worker
        if tokens_per_expert is None:
            if epw != 1:
                raise ValueError(f"tokens_per_expert is required with {epw} experts per worker")
            tpe = [n]
        else:
            tpe = [int(c) for c in tokens_per_expert]
            if len(tpe) != epw or sum(tpe) != n or min(tpe) < 0:
                raise ValueError(f"tokens_per_expert {tpe} must be {epw} counts >= 0 summing to {n}")
        return [int(layer_id), int(batch_id), n, *tpe]


class DispatchReceiver(ABC):
    """async-dispatch-recv, for MoE worker ``worker``: polls all D regions fairly (round robin
    from the region after the last one served), returns one complete region at a time."""

    bell: Doorbell = NapDoorbell(100e-6)

    def __init__(self, config, worker: int):
        self.config, self.spec, self.worker = config, config.spec, worker
        self.policy = config.wait  # NOTE: mutable on purpose: the benchmark compares policies
        self._next_region = 0  # fairness: the scan starts after the region served last
        self._seq = [0] * self.spec.num_groups  # messages delivered per region

    def _scan(self, ready: Callable[[int], bool],
              take: Callable[[int, int], tuple[list[int], torch.Tensor]]) -> DispatchMessage | None:
        """The first region (round robin) whose T lanes are all ``ready``; ``take(lane, member)``
        returns a lane's header words and its payload in private memory."""
        d, t = self.spec.num_groups, self.spec.tp_size
        for k in range(d):
            i = (self._next_region + k) % d
            if all(ready(i * t + j) for j in range(t)):
                self._next_region = (i + 1) % d
                self._seq[i] += 1
                rows = []
                for j in range(t):
                    (layer_id, batch_id, _n, *tpe), payload = take(i * t + j, j)
                    rows.append(DispatchRow(j, layer_id, batch_id, tpe, payload))
                return DispatchMessage(i, self._seq[i], rows)
        return None

    @abstractmethod
    def poll(self) -> DispatchMessage | None:
        """A complete region copied to private memory (flags cleared), or None at once."""

    def recv(self, timeout_s: float | None = None) -> DispatchMessage | None:
        """Wait (per ``self.policy``) for a complete region; None after ``timeout_s``."""
        return wait_for(self.poll, self.bell, self.policy, timeout_s)

    def close(self) -> None:
        pass


class CombineSender(ABC):
    """async-combine-send, for MoE worker ``worker`` (its segment in every attention buffer)."""

    def __init__(self, config, worker: int):
        self.config, self.spec, self.worker = config, config.spec, worker
        self.stats = SendStats()

    @abstractmethod
    def send(self, group: int, member: int, payload: torch.Tensor, layer_id: int, batch_id: int) -> None:
        """Write expert results ``payload`` [n, H] into attention rank (group, member)'s buffer."""

    def close(self) -> None:
        pass

    def header(self, payload: torch.Tensor, layer_id: int, batch_id: int) -> list[int]:
        n = check_payload(payload, self.spec, self.spec.segment_rows)
        return [int(layer_id), int(batch_id), n]


class CombineReceiver(ABC):
    """async-combine-recv, for attention rank (group, member): waits for exactly the MoE workers
    it dispatched to (the E-bit bitmap restricted to them), then copies all their segments out."""

    bell: Doorbell = NapDoorbell(100e-6)

    def __init__(self, config, group: int, member: int):
        self.config, self.spec = config, config.spec
        self.group, self.member = group, member
        self.policy = config.wait

    @abstractmethod
    def poll(self, workers: Sequence[int]) -> CombineMessage | None:
        """Every listed worker's next segment, copied out and cleared; or None at once."""

    def recv(self, workers: Sequence[int], timeout_s: float | None = None) -> CombineMessage | None:
        workers = list(workers)
        return wait_for(lambda: self.poll(workers), self.bell, self.policy, timeout_s)

    def close(self) -> None:
        pass


class Transport:
    """Makes the endpoints of one process. Receivers own their buffers: build them before the
    senders that write into them (senders wait up to ``attach_timeout_s`` for them).

    A transport names its four endpoint classes; they take ``(config, ...ids)``."""

    name: ClassVar[str]
    dispatch_sender_cls: ClassVar[type[DispatchSender]]
    dispatch_receiver_cls: ClassVar[type[DispatchReceiver]]
    combine_sender_cls: ClassVar[type[CombineSender]]
    combine_receiver_cls: ClassVar[type[CombineReceiver]]

    def __init__(self, config):
        self.config = config

    def dispatch_sender(self, group: int, member: int) -> DispatchSender:
        return self.dispatch_sender_cls(self.config, group, member)

    def dispatch_receiver(self, worker: int) -> DispatchReceiver:
        return self.dispatch_receiver_cls(self.config, worker)

    def combine_sender(self, worker: int) -> CombineSender:
        return self.combine_sender_cls(self.config, worker)

    def combine_receiver(self, group: int, member: int) -> CombineReceiver:
        return self.combine_receiver_cls(self.config, group, member)


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    TRANSPORTS[cls.name] = cls
    return cls


def make_transport(config) -> Transport:
    return TRANSPORTS[config.transport](config)


def check_payload(payload: torch.Tensor, spec, capacity: int) -> int:
    """Rows of a valid payload [n, H] of the spec's dtype with n <= capacity."""
    if payload.dim() != 2 or payload.shape[1] != spec.hidden_size:
        raise ValueError(f"payload must be [n, {spec.hidden_size}], got {list(payload.shape)}")
    if payload.dtype != getattr(torch, spec.dtype):
        raise ValueError(f"payload dtype must be {spec.dtype}, got {payload.dtype}")
    n = payload.shape[0]
    if n > capacity:
        raise ValueError(f"payload has {n} rows; a slot holds {capacity} (raise max_batch_tokens)")
    return n


def private_rows(spec, num_lanes: int, rows: int, device: str = "cpu") -> torch.Tensor:
    """Private staging for ``num_lanes`` payloads of ``rows`` rows: [lanes, rows, H]."""
    return torch.empty(num_lanes, rows, spec.hidden_size, dtype=getattr(torch, spec.dtype), device=device)
