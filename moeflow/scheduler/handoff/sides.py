"""The two sides of a KV handoff, each talking to its engine through its ``KvPort`` only.

A ``PrefillSide`` holds the leases: a request that finished its prefill keeps its blocks until its
KV has been copied out (or the handoff is given up). A ``DecodeSide`` holds the reservations:
blocks pre-allocated for a request whose KV is on its way, which joins its group's running set
once the KV is in place. Each sends its copies through a ``Copier``: the engine's (the members
copy through the staging arena, ``engine/kv_copier.py``) or the simulator's (the copy's time on
the clock, ``sim/pd.py``). Whoever opened a stage closes it: a pd deployment
(``deployment.py``), a prefill server, or a decode server that pulled from another host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from moeflow.core import Request
from moeflow.scheduler.handoff.port import KvPort

WRITE, READ = 0, 1  # a stage's copy out of the prefill side, and into the decode side


class Copier(Protocol):
    """How one side's copies are made. ``copy_out``/``copy_in`` may raise when a member is found gone
    (the engine's ``WorkerDied``); the caller fails that instance."""

    def copy_out(self, group: int, stage: Any, blocks: tuple[int, ...]) -> tuple[Any, bool]:
        """The stage the copy in reads, and whether the KV stays in place (nothing copied out: the
        decode side reads the leased blocks, so the lease lasts until the copy in is done)."""

    def copy_in(self, group: int, stage: Any, blocks: tuple[int, ...]) -> None: ...

    def abandon(self, stage: Any, side: int, group: int) -> None:
        """Copies were sent and not all answered: the stage is closed once they have."""


@dataclass(frozen=True)
class Lease:
    request_id: str
    group: int  # the prefill engine's group holding the blocks
    blocks: tuple[int, ...]


class PrefillSide:
    """Lease -> copy out -> lease ended (the stage holds the KV) or dropped; in place: lease -> read
    by the decode side -> lease ended."""

    def __init__(self, port: KvPort, copier: Copier):
        self.port, self.copier = port, copier
        self.leases: dict[str, Lease] = {}

    def lease(self, request_id: str) -> Lease | None:
        """The finished request's leased blocks (None: it holds none: ended by its first token, or failed)."""
        held = self.port.leased(request_id)
        if held is None:
            return None
        lease = self.leases[request_id] = Lease(request_id, *held)
        return lease

    def copy_out(self, request_id: str, stage: Any) -> tuple[Any, bool]:
        """The stage the copy in reads, and whether the KV stays in the leased blocks."""
        lease = self.leases[request_id]
        return self.copier.copy_out(lease.group, stage, lease.blocks)

    def copied(self, request_id: str) -> None:
        """The stage holds the copy (or, in place, the decode side has read it): the blocks are free."""
        self.end(request_id)

    def drop(self, request_id: str, stage: Any = None, answered: bool = True) -> None:
        """Given up: the blocks are freed; a stage whose copies out were sent and not all
        ``answered`` drains before its owner may reuse it."""
        lease = self.leases.get(request_id)
        if stage is not None and not answered and lease is not None:
            self.copier.abandon(stage, WRITE, lease.group)
        self.end(request_id)

    def end(self, request_id: str) -> None:
        """No handoff for it (or its copy is done): its blocks go back."""
        self.leases.pop(request_id, None)
        self.port.end_lease(request_id)


class DecodeSide:
    """Reserve -> copy in -> arrived (it decodes), or dropped (the blocks go back)."""

    def __init__(self, port: KvPort, copier: Copier):
        self.port, self.copier = port, copier
        self.reserved: dict[str, tuple[Request, int, tuple[int, ...]]] = {}  # id -> (request, group, blocks)

    def room(self, request: Request) -> int | None:
        """The group with the most free blocks that has room for ``request`` (None: none has)."""
        return self.port.room(request)

    def reserve(self, request: Request, group: int) -> tuple[int, ...]:
        blocks = self.port.reserve(group, request)
        self.reserved[request.request_id] = (request, group, blocks)
        return blocks

    def group_of(self, request_id: str) -> int:
        return self.reserved[request_id][1]

    def copy_in(self, request_id: str, stage: Any) -> None:
        _, group, blocks = self.reserved[request_id]
        self.copier.copy_in(group, stage, blocks)

    def arrived(self, request_id: str) -> int:
        """Its KV is in its blocks: it runs in their group from the next step; returns the group."""
        request, _, _ = self.reserved.pop(request_id)
        return self.port.arrive(request)

    def drop(self, request_id: str, stage: Any = None, answered: bool = True) -> None:
        """Given up: the reserved blocks go back; a stage whose copies in were sent and not all
        ``answered`` drains before its owner may reuse it."""
        held = self.reserved.pop(request_id, None)
        if stage is not None and not answered and held is not None:
            self.copier.abandon(stage, READ, held[1])
        self.port.cancel(request_id)


def most_room(sides: list[DecodeSide | None], request: Request) -> tuple[int, int] | None:
    """(side, group) of the decode ``sides`` (None: a failed instance) with the most free KV blocks
    that has room for ``request``; None when none has (the request waits for room)."""
    best = None
    for j, side in enumerate(sides):
        gid = side.room(request) if side is not None else None
        if gid is not None:
            free = side.port.free_blocks(gid)
            if best is None or free > best[2]:
                best = (j, gid, free)
    return None if best is None else best[:2]
