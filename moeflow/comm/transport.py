"""The endpoint kinds as base classes, and the registry of transports that implement them.

Nouns. An *expert rank* owns a dispatch buffer of R *regions* x W *lanes*; each lane has one
writer, and a region is complete when all W of its lanes hold a message. Each lane writer owns a
combine buffer with one lane per expert rank (a *segment*: that rank's results). Every lane of
either buffer has ``num_slots`` *slots*. The modes map onto these nouns as follows:

    mode   region                 lane (writer)          expert rank
    asap   attention DP group     TP member of it        MoE worker
    dep    rank                   the rank (W = 1)       the same rank

    lane writer (region r, lane l)                       expert rank e
    DispatchSender.send(e, x, layer, batch, tpe)  ------->   DispatchReceiver.recv() -> DispatchMessage
    CombineReceiver.recv([e, ...]) -> CombineMessage  <---   CombineSender.send(r, l, y, layer, batch)

Legend: n token rows, H hidden size, Epr experts per expert rank. Every payload is [n, H] of the
spec's dtype, 0 <= n <= the slot capacity (``spec.dispatch_rows`` / ``spec.segment_rows``).

Dispatch and combine are the four primitives every transport has today; they are not the only
kinds of endpoint there may be. A transport may add more beside them: DWDP's one-sided *weight
pull* (a rank copies a peer's resident expert weights out of the peer's shared memory without the
peer doing anything) is one: ``weight_store`` (``comm/weights.py``). ``Transport`` builds every
kind the same way.

Contract shared by every transport (dispatch and combine):
- A send returns once the payload is out of the caller's tensor: in the receiver's shared
  buffer (shm), in a staging slot handed to isend (dist), or taken by the receiver (the
  blocking baselines p2p and shm-handshake). The caller may reuse its tensor at once.
- Messages of one lane (one sender to one receiver) arrive in order, each exactly once.
- A one-sided send waits only when its slot still holds an unread message (backpressure, in
  ``stats``). A lane writer keeps at most ``num_slots`` batches in flight, which makes the
  dispatch/combine cycle deadlock-free: a reply always finds its slot free.
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
    """async-dispatch-send, for lane ``lane`` of region ``region`` (the lane ``lane_id`` =
    ``region * W + lane`` in every expert rank's dispatch buffer)."""

    def __init__(self, config, region: int, lane: int):
        self.config, self.spec = config, config.spec
        self.region, self.lane = region, lane
        self.lane_id = config.spec.lane_id(region, lane)
        self.stats = SendStats()

    @abstractmethod
    def send(self, rank: int, payload: torch.Tensor, layer_id: int, batch_id: int,
             tokens_per_expert: Sequence[int] | None = None) -> None:
        """Write ``payload`` [n, H] (rows grouped by local expert) into expert rank ``rank``'s
        buffer. ``tokens_per_expert`` [Epr]: rows per local expert, summing to n (may be None
        when Epr == 1). All W lanes of a region send to the same ranks in the same order,
        n = 0 included: the receiver waits for all W lanes of a region."""

    def detach(self, rank: int) -> None:
        """Let expert rank ``rank``'s buffer go: it left an elastic deployment (one that joins at
        its index later is written from the start of a new buffer)."""
        raise NotImplementedError(f"transport {self.config.transport!r}: expert ranks cannot leave while serving")

    def close(self) -> None:
        pass

    def header(self, payload: torch.Tensor, layer_id: int, batch_id: int,
               tokens_per_expert: Sequence[int] | None) -> list[int]:
        """Validated header words: layer id, batch id, n, tokens per local expert [Epr]."""
        n = check_payload(payload, self.spec, self.spec.dispatch_rows)
        epr = self.spec.experts_per_rank
        if tokens_per_expert is None:
            if epr != 1:
                raise ValueError(f"tokens_per_expert is required with {epr} experts per rank")
            tpe = [n]
        else:
            tpe = [int(c) for c in tokens_per_expert]
            if len(tpe) != epr or sum(tpe) != n or min(tpe) < 0:
                raise ValueError(f"tokens_per_expert {tpe} must be {epr} counts >= 0 summing to {n}")
        return [int(layer_id), int(batch_id), n, *tpe]


class DispatchReceiver(ABC):
    """async-dispatch-recv, for expert rank ``rank``: polls all R regions fairly (round robin
    from the region after the last one served), returns one complete region at a time."""

    bell: Doorbell = NapDoorbell(100e-6)

    def __init__(self, config, rank: int):
        self.config, self.spec, self.rank = config, config.spec, rank
        self.policy = config.wait  # NOTE: mutable on purpose: the benchmark compares policies
        self._next_region = 0  # fairness: the scan starts after the region served last
        self._seq = [0] * self.spec.num_regions  # messages delivered per region

    def _scan(self, ready: Callable[[int], bool],
              take: Callable[[int, int], tuple[list[int], torch.Tensor]]) -> DispatchMessage | None:
        """The first region (round robin) whose W lanes are all ``ready(lane_id)``;
        ``take(lane_id, lane)`` returns a lane's header words and its payload in private memory."""
        r, w = self.spec.num_regions, self.spec.lanes_per_region
        for k in range(r):
            i = (self._next_region + k) % r
            if all(ready(i * w + j) for j in range(w)):
                self._next_region = (i + 1) % r
                self._seq[i] += 1
                rows = []
                for j in range(w):
                    (layer_id, batch_id, _n, *tpe), payload = take(i * w + j, j)
                    rows.append(DispatchRow(j, layer_id, batch_id, tpe, payload))
                return DispatchMessage(i, self._seq[i], rows)
        return None

    @abstractmethod
    def poll(self) -> DispatchMessage | None:
        """A complete region copied to private memory (flags cleared), or None at once."""

    def recv(self, timeout_s: float | None = None) -> DispatchMessage | None:
        """Wait (per ``self.policy``) for a complete region; None after ``timeout_s``."""
        return wait_for(self.poll, self.bell, self.policy, timeout_s)

    def forget_region(self, region: int) -> None:
        """Region ``region``'s writers left an elastic deployment (an attention group): one that joins
        at its index later writes from seq 1 again. Called once every message of theirs is served."""
        raise NotImplementedError(f"transport {self.config.transport!r}: attention groups cannot leave while serving")

    def close(self) -> None:
        pass


class CombineSender(ABC):
    """async-combine-send, for expert rank ``rank`` (its lane in every lane writer's combine buffer)."""

    def __init__(self, config, rank: int):
        self.config, self.spec, self.rank = config, config.spec, rank
        self.stats = SendStats()

    @abstractmethod
    def send(self, region: int, lane: int, payload: torch.Tensor, layer_id: int, batch_id: int) -> None:
        """Write expert results ``payload`` [n, H] into the combine buffer of lane (region, lane)'s writer."""

    def detach_region(self, region: int) -> None:
        """Let region ``region``'s combine buffers go: its group left an elastic deployment (one that
        joins at its index later owns new buffers, written from seq 1 again)."""
        raise NotImplementedError(f"transport {self.config.transport!r}: attention groups cannot leave while serving")

    def close(self) -> None:
        pass

    def header(self, payload: torch.Tensor, layer_id: int, batch_id: int) -> list[int]:
        n = check_payload(payload, self.spec, self.spec.segment_rows)
        return [int(layer_id), int(batch_id), n]


class CombineReceiver(ABC):
    """async-combine-recv, for the writer of lane (region, lane): waits for exactly the expert
    ranks it dispatched to (the E-bit bitmap restricted to them), then copies all their segments out."""

    bell: Doorbell = NapDoorbell(100e-6)

    def __init__(self, config, region: int, lane: int):
        self.config, self.spec = config, config.spec
        self.region, self.lane = region, lane
        self.lane_id = config.spec.lane_id(region, lane)
        self.policy = config.wait

    def forget(self, rank: int) -> None:
        """Expert rank ``rank`` left an elastic deployment: one that joins at its index later writes
        its segment from seq 1 again."""
        raise NotImplementedError(f"transport {self.config.transport!r}: expert ranks cannot leave while serving")

    @abstractmethod
    def poll(self, ranks: Sequence[int]) -> CombineMessage | None:
        """Every listed expert rank's next segment, copied out and cleared; or None at once."""

    def recv(self, ranks: Sequence[int], timeout_s: float | None = None) -> CombineMessage | None:
        ranks = list(ranks)
        return wait_for(lambda: self.poll(ranks), self.bell, self.policy, timeout_s)

    def close(self) -> None:
        pass


class Transport:
    """Makes the endpoints of one process. Owners of buffers (the receivers) build them before the
    endpoints that attach to them (senders wait up to ``attach_timeout_s`` for them).

    A transport names a class per endpoint kind as ``<kind>_cls``, built by ``endpoint(kind, *ids)``
    as ``cls(config, *ids)``. The four below are dispatch/combine; a transport may name more kinds
    (a weight pull), each with a factory method like these; a kind it lacks is NotImplementedError."""

    name: ClassVar[str]
    dispatch_sender_cls: ClassVar[type[DispatchSender]]
    dispatch_receiver_cls: ClassVar[type[DispatchReceiver]]
    combine_sender_cls: ClassVar[type[CombineSender]]
    combine_receiver_cls: ClassVar[type[CombineReceiver]]

    def __init__(self, config):
        self.config = config

    def endpoint(self, kind: str, *ids: int, **extra):
        """``extra``: what a transport hands each of its endpoints besides the ids (the reference's hub)."""
        cls = getattr(self, f"{kind}_cls", None)
        if cls is None:
            raise NotImplementedError(f"transport {self.name!r} has no {kind} endpoint")
        return cls(self.config, *ids, **extra)

    def dispatch_sender(self, region: int, lane: int) -> DispatchSender:
        return self.endpoint("dispatch_sender", region, lane)

    def dispatch_receiver(self, rank: int) -> DispatchReceiver:
        return self.endpoint("dispatch_receiver", rank)

    def combine_sender(self, rank: int) -> CombineSender:
        return self.endpoint("combine_sender", rank)

    def combine_receiver(self, region: int, lane: int) -> CombineReceiver:
        return self.endpoint("combine_receiver", region, lane)

    def weight_store(self, publishers: tuple[int, ...] | None = None):
        """One-sided weight pulls (``comm/weights.py``): publish this rank's tensors, read peers'.
        ``publishers``: the world ranks that publish, when not all do (expert workers under EPLB)."""
        return self.endpoint("weight_store", publishers=publishers)

    @classmethod
    def mailbox_bytes(cls, config, node: int = 0) -> int:
        """/dev/shm bytes the receivers of ``config`` create on host ``node`` (0: a transport without
        shared buffers). Published weights (dwdp) are the caller's to add."""
        return 0


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    TRANSPORTS[cls.name] = cls
    return cls


def make_transport(config) -> Transport:
    return TRANSPORTS[config.transport](config)


def mailbox_bytes(config, node: int = 0) -> int:
    """What ``config``'s transport keeps in /dev/shm on host ``node`` for its dispatch and combine buffers."""
    return TRANSPORTS[config.transport].mailbox_bytes(config, node)


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
