"""A pd deployment's handoffs between its prefill and decode instances: the state machine that the
engine (``engine/pd.py``, polling its members' flags) and the simulator (``sim/pd.py``, on its
clock) both run.

Per request: ``pending`` (its blocks leased on the prefill instance, waiting for decode room and a
stage) -> ``writing`` (blocks reserved on the decode instance with the most free KV; the prefill
members copy into the stage) -> ``reading`` (the lease ended: the stage holds the copy; the decode
members copy into the reserved blocks) -> arrived (it decodes). In place (the prefill instance's
caches are shared, one host): ``writing`` copies nothing and ends at once, ``reading`` copies
straight out of the leased blocks, and the lease ends with it. A failed copy, a lease that runs
out, or a dead instance gives the handoff up: every block is freed, then the policy: ``recompute``
(the prompt and the first token on the live decode instance with the most free KV) or ``fail``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from moeflow.core import Request
from moeflow.scheduler.handoff.sides import DecodeSide, Lease, PrefillSide, most_room


class Stages(Protocol):
    """Where a copy waits between the sides: the engine's staging arena, or the simulator's none."""

    def open(self, request: Request) -> Any | None:
        """A stage for the request's prompt KV, or None while there is no room."""

    def close(self, stage: Any) -> None: ...


@dataclass
class HandoffStats:
    """Counters and the handoff-time samples since start (a server exports them)."""

    transfers: int = 0
    failures: int = 0  # copies that failed (injected or not)
    lease_expiries: int = 0
    recomputes: int = 0  # handoffs given up and recomputed on the decode side
    bytes_total: int = 0
    seconds: list[float] = field(default_factory=list)  # per handoff: decode room found -> KV in place
    prealloc_wait_s: list[float] = field(default_factory=list)  # per handoff: first token -> decode room


@dataclass
class Handoff:
    """One request between its prefill and decode instances."""

    request: Request  # the client's (every token lands here)
    decode_request: Request  # the decode side's copy: the prompt and the prefill side's first token
    prefill: int  # prefill instance
    lease: Lease
    prefilled_s: float  # the first token was sampled (the lease started)
    state: str = "pending"  # pending (no decode room yet) -> writing -> reading -> arrived
    decode: int | None = None
    stage: Any = None
    started_s: float | None = None  # decode room found: blocks reserved, the copy out began
    in_place: bool = False  # nothing copied out: the copy in reads the leased blocks
    written_s: float | None = None  # the copy out done: the copy in began

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class GivenUp:
    handoff: Handoff
    why: str
    recompute_on: int | None  # the decode instance to recompute it on; None: it fails


class PdHandoffs:
    def __init__(self, prefill: list[PrefillSide], decode: list[DecodeSide], stages: Stages, lease_s: float,
                 policy: str, live: Callable[[str, int], bool] = lambda side, i: True):
        """``live(side, i)``: whether instance ``i`` of ``side`` ("prefill" | "decode") still serves."""
        self.prefill, self.decode, self.stages = prefill, decode, stages
        self.lease_s, self.policy, self.live = lease_s, policy, live
        self.handoffs: dict[str, Handoff] = {}  # oldest first
        self.stats = HandoffStats()

    def __len__(self) -> int:
        return len(self.handoffs)

    def prefilled(self, i: int, request: Request, decode_request: Request, now: float) -> Handoff | None:
        """Prefill instance ``i`` finished ``request``'s prefill (None: it leased no blocks)."""
        lease = self.prefill[i].lease(request.request_id)
        if lease is None:
            return None
        h = self.handoffs[request.request_id] = Handoff(request, decode_request, i, lease, now)
        return h

    def expired(self, h: Handoff, now: float) -> GivenUp | None:
        """A handoff still on the prefill side past its lease is given up."""
        if h.state not in ("pending", "writing") or now - h.prefilled_s <= self.lease_s:
            return None
        return self.expire(h)

    def expire(self, h: Handoff) -> GivenUp:
        """``h``'s lease ran out while it was still on the prefill side."""
        self.stats.lease_expiries += 1
        why = "no decode instance had room" if h.state == "pending" else "the copy out stalled"
        return self.give_up(h, f"its KV lease expired after {self.lease_s:g} s ({why})", answered=False)

    def start(self, h: Handoff, now: float) -> bool:
        """Decode room (the instance with the most free KV) and a stage: blocks reserved, the copy
        out sent (a member found gone raises: the caller gives the handoff up)."""
        best = most_room([d if self.live("decode", j) else None for j, d in enumerate(self.decode)],
                         h.decode_request)
        if best is None:
            return False
        stage = self.stages.open(h.request)
        if stage is None:
            return False
        j, gid = best
        h.decode, h.stage, h.started_s, h.state = j, stage, now, "writing"
        self.decode[j].reserve(h.decode_request, gid)
        self.stats.prealloc_wait_s.append(now - h.prefilled_s)
        h.stage, h.in_place = self.prefill[h.prefill].copy_out(h.request_id, stage)
        return True

    def copied_out(self, h: Handoff, ok: bool, now: float) -> GivenUp | None:
        """The prefill members' copies answered: the lease ends and the copy in is sent."""
        if not ok:
            self.stats.failures += 1
            return self.give_up(h, "its KV copy out of the prefill instance failed")
        h.written_s, h.state = now, "reading"
        if not h.in_place:
            self.prefill[h.prefill].copied(h.request_id)
        self.decode[h.decode].copy_in(h.request_id, h.stage)
        return None

    def copied_in(self, h: Handoff, ok: bool, now: float, nbytes: int = 0) -> GivenUp | None:
        """The decode members' copies answered: the request decodes there from its next step."""
        if not ok:
            self.stats.failures += 1
            return self.give_up(h, "its KV copy into the decode instance failed")
        s = self.stats
        s.transfers, s.bytes_total = s.transfers + 1, s.bytes_total + nbytes
        s.seconds.append(now - h.started_s)
        del self.handoffs[h.request_id]
        self.stages.close(h.stage)
        if h.in_place:
            self.prefill[h.prefill].copied(h.request_id)
        self.decode[h.decode].arrived(h.request_id)
        return None

    def give_up(self, h: Handoff, why: str, answered: bool = True) -> GivenUp:
        """Blocks freed on both sides (a stage whose copies were not all ``answered`` drains first),
        then the policy."""
        self.drop(h, answered)
        live = [j for j in range(len(self.decode)) if self.live("decode", j)]
        on = max(live, key=lambda j: self.decode[j].port.free_blocks()) \
            if self.policy == "recompute" and live else None
        return GivenUp(h, why, on)

    def drop(self, h: Handoff, answered: bool = False) -> None:
        """Forget ``h`` (an abort, or given up), freeing what it holds."""
        self.handoffs.pop(h.request_id, None)
        rid, stage = h.request_id, h.stage
        self.prefill[h.prefill].drop(rid, stage if h.state == "writing" else None, answered)
        if h.decode is not None:
            self.decode[h.decode].drop(rid, stage if h.state == "reading" else None, answered)
        if stage is not None and answered:
            self.stages.close(stage)
