"""The handoff's lifecycle, between a pd deployment's instances (``engine/pd.py`` mixes it in).

Per request: ``pending`` (its blocks leased on the prefill instance, waiting for decode room) ->
``writing`` (blocks reserved on the decode instance with the most free KV; the prefill members
copy into a stage) -> ``reading`` (the lease ended: the stage holds the copy; the decode members
copy into the reserved blocks) -> arrived (it decodes). A failed copy, a lease that runs out, or
a dead instance gives up the handoff: every block is freed, then ``kv_load_failure_policy``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeflow.comm.kv_arena import READ, WRITE
from moeflow.core import Request
from moeflow.engine.base import KvTransfer, StepResult, clock
from moeflow.engine.kv_handoff import DONE, FAILED
from moeflow.messages import KvRecv, KvSend, KvStage, Span
from moeflow.scheduler.handoff import most_room
from moeflow.workers.launch import WorkerDied


@dataclass
class Handoff:
    """One request between its prefill and decode instances."""

    request: Request  # the client's (every token lands here)
    decode_request: Request  # the decode side's copy: the prompt and the prefill side's first token
    prefill: int  # prefill instance
    prefill_group: int  # its group holding the blocks (under the lease)
    prefill_blocks: tuple[int, ...]
    prefilled_s: float  # the first token was sampled (the lease started)
    state: str = "pending"  # pending (no decode room yet) -> writing -> reading -> arrived
    decode: int | None = None
    decode_group: int | None = None
    decode_blocks: tuple[int, ...] = ()
    stage: KvStage | None = None
    started_s: float | None = None  # decode room found: blocks reserved, the copy out began
    written_s: float | None = None  # the copy out done: the copy in began


class Handoffs:
    """The state machine; the engine provides ``prefill``, ``decode``, ``layout``, ``kv``,
    ``handoffs``, ``handoff_s``, ``where``, ``_fail_prob``, ``_rng``, ``_finish``, ``_decoded`` and
    ``_prefilled``."""

    def _advance(self, out: StepResult) -> None:
        """Every handoff as far as it can go now, oldest first (an in-process copy is done when sent:
        its next state follows at once)."""
        now = clock()
        self.kv.drain()
        for h in list(self.handoffs.values()):
            state = None
            while h.state != state and h.request.request_id in self.handoffs:
                state = h.state
                self._look(h, now, out)

    def _look(self, h: Handoff, now: float, out: StepResult) -> None:
        if h.state in ("pending", "writing") and self.prefill[h.prefill].failed is not None:
            self._give_up(h, f"prefill instance {h.prefill} failed: {self.prefill[h.prefill].failed}", out)
        elif h.state == "reading" and self.decode[h.decode].failed is not None:
            self._give_up(h, f"decode instance {h.decode} failed: {self.decode[h.decode].failed}", out)
        elif h.state in ("pending", "writing") and now - h.prefilled_s > self.layout.kv_lease_s:
            self.kv.stats.lease_expiries += 1
            why = "no decode instance had room" if h.state == "pending" else "the copy out stalled"
            self._give_up(h, f"its KV lease expired after {self.layout.kv_lease_s:g} s ({why})", out)
        elif h.state == "pending":
            self._start(h, now, out)
        elif h.state == "writing":
            self._poll(h, WRITE, self.prefill[h.prefill].kv_members(h.prefill_group), out)
        elif h.state == "reading":
            self._poll(h, READ, self.decode[h.decode].kv_members(h.decode_group), out)

    def _start(self, h: Handoff, now: float, out: StepResult) -> None:
        """Decode room (the instance with the most free KV) and a stage: blocks reserved, copy out sent."""
        best = most_room([e.arrivals if e.failed is None else None for e in self.decode], h.decode_request)
        if best is None:
            return
        stage = self.kv.open(h.request.num_prompt_tokens)
        if stage is None:
            return
        j, gid = best
        h.decode, h.decode_group, h.stage, h.started_s, h.state = j, gid, stage, now, "writing"
        h.decode_blocks = self.decode[j].arrivals.reserve(gid, h.decode_request)
        self.kv.stats.prealloc_wait_s.append(now - h.prefilled_s)
        out.prealloc_waits_s.append(now - h.prefilled_s)
        self._send(h, WRITE, KvSend(self._maybe_fail(stage), h.prefill_blocks), out)

    def _send(self, h: Handoff, side: int, message, out: StepResult) -> None:
        """A copy message to the group's members; one found gone fails its instance (or rank) at once,
        with the requests it held, and this handoff is given up (a dead member never answers)."""
        name, i, group = ("prefill", h.prefill, h.prefill_group) if side == WRITE else \
            ("decode", h.decode, h.decode_group)
        engine = getattr(self, name)[i]
        try:
            engine.send_kv(group, message)
        except WorkerDied as e:
            ended = StepResult({}, engine.member_died(group, str(e)))
            self._decoded(ended, out) if side == READ else self._prefilled(i, ended, out)
            self._give_up(h, f"{name} instance {i} failed: {e}", out, closed=engine.kv_members(group) == 1)

    def _maybe_fail(self, stage):
        if self._fail_prob and self._rng.random() < self._fail_prob:
            return dataclasses.replace(stage, fail=True)
        return stage

    def _poll(self, h: Handoff, side: int, members: int, out: StepResult) -> None:
        state = self.kv.status(h.stage, side, members)
        if state == FAILED:
            self.kv.stats.failures += 1
            self._give_up(h, "its KV copy " + ("out of the prefill instance" if side == WRITE else
                                               "into the decode instance") + " failed", out, closed=True)
        elif state == DONE and side == WRITE:
            h.written_s = clock()
            self.prefill[h.prefill].scheduler.pool.end_lease(h.request.request_id)  # the stage holds a copy now
            self.kv.arena.flags[h.stage.slot, READ].zero_()
            h.state = "reading"
            self._send(h, READ, KvRecv(self._maybe_fail(h.stage), h.decode_blocks), out)
        elif state == DONE:
            s = self.kv.stats
            s.transfers += 1
            s.bytes_total += self.kv.bytes_for(h.stage.num_tokens)
            s.seconds.append(clock() - h.started_s)
            out.kv_transfers.append(KvTransfer(s.seconds[-1], self.kv.bytes_for(h.stage.num_tokens), "shm"))
            self.handoff_s[h.request.request_id] = s.seconds[-1]  # goes out with its first decode output
            self.kv.close(h.stage)
            del self.handoffs[h.request.request_id]
            if self.config.trace:
                self.spans += handoff_spans(h, clock())
            self.decode[h.decode].admit_arrived(h.decode_request)
            self.where[h.request.request_id] = ("decode", h.decode)

    def _give_up(self, h: Handoff, why: str, out: StepResult, closed: bool = False) -> None:
        """The handoff failed: blocks freed on both sides, then the policy: fail, or recompute the
        prompt on a decode instance (from the prompt and the first token)."""
        del self.handoffs[h.request.request_id]
        self._drop_handoff(h, closed)
        rid = h.request.request_id
        live = [j for j, e in enumerate(self.decode) if e.failed is None]
        if self.layout.kv_load_failure_policy == "recompute" and live:
            j = max(live, key=lambda j: self.decode[j].load().num_free_kv_blocks)
            try:
                self.decode[j].add_request(h.decode_request)
                self.kv.stats.recomputes += 1
                self.where[rid] = ("decode", j)
                return
            except Exception as e:  # noqa: BLE001  (then the request fails with both reasons)
                why += f"; recomputing it failed: {e}"
        self._finish(h.request, out, f"request {rid}: {why}", "error")

    def _drop_handoff(self, h: Handoff, closed: bool = False) -> None:
        """Free what a handoff holds: the prefill lease, the decode reservation, its stage."""
        self.prefill[h.prefill].scheduler.pool.end_lease(h.request.request_id)
        if h.decode is not None:
            self.decode[h.decode].arrivals.cancel(h.request.request_id)
        if h.stage is not None:
            if closed:
                self.kv.close(h.stage)
            else:
                e, g = (self.prefill[h.prefill], h.prefill_group) if h.state == "writing" else \
                    (self.decode[h.decode], h.decode_group)
                self.kv.abandon(h.stage, WRITE if h.state == "writing" else READ, e.kv_members(g))


def handoff_spans(h: Handoff, arrived_s: float) -> list[Span]:
    """One handoff on the trace's "handoff" track, between the two sides' tracks: waiting for decode
    room, the copy out of the prefill instance and the copy into the decode instance, each from the
    message sent to every member's flag (the members' own "kv copy" spans say what the copy took)."""
    track = f"handoff/prefill{h.prefill}->decode{h.decode}"
    args = {"request": h.request.request_id, "tokens": h.stage.num_tokens}
    return [Span("handoff: wait for decode room", track, h.prefilled_s, h.started_s, args),
            Span("handoff: out (sent to done)", track, h.started_s, h.written_s, args),
            Span("handoff: in (sent to done)", track, h.written_s, arrived_s, args)]
