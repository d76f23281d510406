"""The engine's drive of a pd deployment's handoffs: the state machine is the simulator's too
(``scheduler/handoff/deployment.py``); here each copy is the members' (``kv_copier.py``), and its
end is seen in their flags, polled between steps. What comes of each handoff goes back to the
``PdEngine`` as outcomes: arrived, given up (then the policy), or requests a dead member ended.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from moeflow.comm.kv_arena import READ, WRITE
from moeflow.core import Request
from moeflow.engine.base import Engine, KvTransfer, StepResult, clock
from moeflow.engine.kv_copier import EngineCopier
from moeflow.engine.kv_handoff import DONE, FAILED, KvConnector
from moeflow.layout import PdLayout
from moeflow.messages import Span
from moeflow.scheduler.handoff.deployment import Handoff, PdHandoffs
from moeflow.scheduler.handoff.sides import DecodeSide, PrefillSide
from moeflow.settings import pd_fail_prob
from moeflow.workers.launch import WorkerDied


@dataclass(frozen=True)
class Arrived:
    request_id: str
    decode: int
    seconds: float  # its handoff: decode room found -> KV in place


@dataclass(frozen=True)
class Ended:
    """A member was found gone while a copy was sent: its instance failed, ending these requests."""

    side: str
    instance: int
    finished: list[Request]


class HandoffDriver:
    def __init__(self, prefill: list[Engine], decode: list[Engine], kv: KvConnector, layout: PdLayout,
                 seed: int, trace: bool):
        """``prefill``/``decode``: the deployment's instances (lists it replaces items of when it heals)."""
        self.engines = {"prefill": prefill, "decode": decode}
        self.kv, self.trace = kv, trace
        self.spans: list[Span] = []  # the handoffs' trace spans since the last collect_spans
        self.copiers: dict[tuple[str, int], EngineCopier] = {}
        self._fail_prob, self._rng = pd_fail_prob(), random.Random(seed)
        self.machine = PdHandoffs([PrefillSide(*self._port("prefill", i)) for i in range(len(prefill))],
                                  [DecodeSide(*self._port("decode", j)) for j in range(len(decode))],
                                  _Stages(kv), layout.kv_lease_s, layout.kv_load_failure_policy,
                                  lambda side, i: self.engines[side][i].failed is None)
        kv.stats = self.machine.stats  # one set of counters: the handoffs'

    def _port(self, side: str, i: int):
        """(port, copier) of instance ``i`` of ``side``: its engine's port, its copies through our arena."""
        port = self.engines[side][i].handoff_port()
        c = self.copiers[(side, i)] = EngineCopier(self.kv, port, self._fail_prob, self._rng)
        return port, c

    def rebuilt(self, side: str, i: int) -> None:
        """Instance ``i`` of ``side`` was replaced (healed): its side talks to the new engine."""
        sides = getattr(self.machine, side)
        sides[i] = type(sides[i])(*self._port(side, i))

    def advance(self, out: StepResult) -> list:
        """Every handoff as far as it can go now, oldest first (an in-process copy is done when sent:
        its next state follows at once); the outcomes, in order."""
        now, outcomes = clock(), []
        self.kv.drain()
        handoffs = self.machine.handoffs
        for h in list(handoffs.values()):
            state = None
            while h.state != state and h.request_id in handoffs:
                state = h.state
                self._look(h, now, out, outcomes)
        return outcomes

    def _look(self, h: Handoff, now: float, out: StepResult, outcomes: list) -> None:
        m = self.machine
        side, i = ("decode", h.decode) if h.state == "reading" else ("prefill", h.prefill)
        if (why := self.engines[side][i].failed) is not None:
            outcomes.append(m.give_up(h, f"{side} instance {i} failed: {why}", answered=False))
        elif (g := m.expired(h, now)) is not None:
            outcomes.append(g)
        elif h.state == "pending":
            if self._sending(h, lambda: m.start(h, now), outcomes):
                out.prealloc_waits_s.append(now - h.prefilled_s)
        elif (ok := self._answered(h)) is None:
            return
        elif h.state == "writing":
            g = self._sending(h, lambda: m.copied_out(h, ok, clock()), outcomes)
            if g is not None:
                outcomes.append(g)
        else:
            self._copied_in(h, ok, out, outcomes)

    def _answered(self, h: Handoff) -> bool | None:
        """Whether the copy of ``h``'s state succeeded, once every member has answered (None: not yet)."""
        if h.state == "writing":
            copier, side, group = self.copiers[("prefill", h.prefill)], WRITE, h.lease.group
        else:
            copier, side, group = self.copiers[("decode", h.decode)], READ, \
                self.machine.decode[h.decode].group_of(h.request_id)
        state = copier.status(h.stage, side, group)
        return None if state not in (DONE, FAILED) else state == DONE

    def _copied_in(self, h: Handoff, ok: bool, out: StepResult, outcomes: list) -> None:
        nbytes = self.kv.bytes_for(h.stage.num_tokens)
        g = self.machine.copied_in(h, ok, clock(), nbytes)
        if g is not None:
            outcomes.append(g)
            return
        secs = self.machine.stats.seconds[-1]
        out.kv_transfers.append(KvTransfer(secs, nbytes, "shm"))
        if self.trace:
            self.spans += handoff_spans(h, clock())
        outcomes.append(Arrived(h.request_id, h.decode, secs))

    def _sending(self, h: Handoff, act, outcomes: list):
        """``act()``, which may send a copy message to a group's members. One found gone fails its
        instance (or rank) at once, with the requests it held, and the handoff is given up (a dead
        member never answers); then None."""
        try:
            return act()
        except WorkerDied as e:
            side, i = ("prefill", h.prefill) if h.state == "writing" else ("decode", h.decode)
            group = h.lease.group if side == "prefill" else self.machine.decode[i].group_of(h.request_id)
            engine = self.engines[side][i]
            alone = engine.handoff_port().members(group) == 1
            outcomes.append(Ended(side, i, engine.member_died(group, str(e))))
            if h.request_id in self.machine.handoffs:
                outcomes.append(self.machine.give_up(h, f"{side} instance {i} failed: {e}", answered=alone))
            return None


class _Stages:
    """The deployment's stages: ranges of its staging arena."""

    def __init__(self, kv: KvConnector):
        self.kv = kv

    def open(self, request: Request):
        return self.kv.open(request.num_prompt_tokens)

    def close(self, stage) -> None:
        self.kv.close(stage)


def handoff_spans(h: Handoff, arrived_s: float) -> list[Span]:
    """One handoff on the trace's "handoff" track, between the two sides' tracks: waiting for decode
    room, the copy out of the prefill instance (none in place) and the copy into the decode
    instance, each from the message sent to every member's flag (the members' own "kv copy" spans
    say what the copy took)."""
    track = f"handoff/prefill{h.prefill}->decode{h.decode}"
    args = {"request": h.request_id, "tokens": h.stage.num_tokens}
    wait = Span("handoff: wait for decode room", track, h.prefilled_s, h.started_s, args)
    if h.in_place:
        return [wait, Span("handoff: in, from the prefill cache (sent to done)", track, h.written_s, arrived_s, args)]
    return [wait, Span("handoff: out (sent to done)", track, h.started_s, h.written_s, args),
            Span("handoff: in (sent to done)", track, h.written_s, arrived_s, args)]

