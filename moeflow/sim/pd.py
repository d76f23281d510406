"""A prefill/decode-disaggregated deployment (``PdLayout``) as the engine's mode ``pd`` runs it.

X prefill instances and Y decode instances, each a whole simulated system of its own layout (any
simulated mode, built by ``make_system``), on one event loop. A request runs on the prefill
instance with the fewest unfinished requests with ``max_tokens=1``; its first token is the
client's (TTFT, as the one-command deployment streams it) and its blocks stay leased there. Then,
oldest first, each prefilled request waits for decode room (the decode instance and group with the
most free KV blocks, blocks reserved: the pre-allocation queue); the copy out of the prefill
instance ends the lease, the copy in lands the KV, and the request decodes there. A request that
waits longer than ``kv_lease_s`` gives its blocks up: ``recompute`` prefills its prompt again on a
decode instance, ``fail`` fails it (a failed request of the point). The handoff's states and
decisions are the engine's own (``scheduler/handoff/deployment.py``); here a copy takes its time
on the clock. The staging buffer's size (``kv_buffer_mib``) is not modelled: every handoff that
found decode room copies at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from moeflow.core import Request, SamplingParams
from moeflow.measure.metrics import RequestRecord
from moeflow.scheduler.handoff.deployment import GivenUp, PdHandoffs
from moeflow.scheduler.handoff.sides import DecodeSide, PrefillSide
from moeflow.sim.system import System, _Track


@dataclass(frozen=True)
class _Stage:
    request_id: str
    nbytes: float


class _Stages:
    """Stages without a capacity: every handoff that found decode room copies at once."""

    def __init__(self, kv_bytes_per_token: float):
        self.kv_bytes_per_token = kv_bytes_per_token

    def open(self, request: Request) -> _Stage:
        return _Stage(request.request_id, request.num_prompt_tokens * self.kv_bytes_per_token)

    def close(self, stage: _Stage) -> None:
        pass


class _Copier:
    """A side's copy as time on the clock, then ``done(request id)``. In place, as the engine's pd
    deployment hands KV over on one host: nothing is copied out, and the copy in reads the leased
    blocks; it takes the cost model's whole handoff (its copy out and copy in)."""

    def __init__(self, system: "PdSystem", done):
        self.system, self.done = system, done

    def _after(self, seconds: float, stage: _Stage) -> None:
        loop = self.system.loop
        loop.at(loop.now + seconds, self.done, stage.request_id)

    def copy_out(self, group: int, stage: _Stage, blocks) -> tuple[_Stage, bool]:
        self._after(0.0, stage)
        return stage, True

    def copy_in(self, group: int, stage: _Stage, blocks) -> None:
        self._after(sum(self.system.link_cost("prefill", "decode").kv_handoff_s(stage.nbytes)), stage)

    def abandon(self, stage: _Stage, side: int, group: int) -> None:
        pass


class PdSystem(System):
    def __init__(self, spec, cost, trace_until_s=0.0, make_system=None):
        super().__init__(spec, cost, trace_until_s)
        lay = spec.layout
        self.prefill = [self._instance(make_system, lay.prefill, f"prefill{i}", partial(self._prefilled, i), "prefill")
                        for i in range(lay.prefill_instances)]
        self.decode = [self._instance(make_system, lay.decode, f"decode{j}", self._decoded, "decode")
                       for j in range(lay.decode_instances)]
        m = self.model
        self.machine = PdHandoffs(
            [PrefillSide(p.handoff_port(), _Copier(self, self._copied_out)) for p in self.prefill],
            [DecodeSide(d.handoff_port(), _Copier(self, self._landed)) for d in self.decode],
            _Stages(m.kv_bytes_per_token_layer * m.num_layers), lay.kv_lease_s, lay.kv_load_failure_policy)
        self.requests: dict[str, Request] = {}  # the client's, until it finishes
        self.tracks: dict[str, _Track] = {}  # a handoff's: arrival, first batch, first token and compute so far
        self.handoff_s: dict[str, float] = {}  # landed on a decode instance: its handoff's seconds

    @property
    def prefill_serving(self) -> int:
        """The prefill instances that take prompts: the first ones (an elastic deployment's last leave)."""
        return len(self.prefill)

    @property
    def lease_expiries(self) -> int:
        return self.machine.stats.lease_expiries

    @property
    def waiting(self) -> dict:
        """Prefilled handoffs without decode room yet, oldest first."""
        return {rid: h for rid, h in self.machine.handoffs.items() if h.state == "pending"}

    def _instance(self, make_system, layout, name: str, sink, role: str) -> System:
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}.{name}", layout=layout, hardware=(),
                                   autoscale=())  # an elastic deployment's controller sizes the instances, not them
        s = make_system(spec, self.cost_of(role))  # on its side's hardware
        # one clock for the deployment, one pool of cores for all its processes; finished requests come here
        s.loop, s.cores, s.sink = self.loop, self.cores, sink
        return s

    def add(self, request: Request) -> None:
        i = min(range(self.prefill_serving), key=lambda i: (len(self.prefill[i].track), i))
        self.requests[request.request_id] = request
        first = Request(request.request_id, request.prompt_token_ids,
                        dataclasses.replace(request.params, max_tokens=1), request.arrival_s, kv_handoff=True)
        self.prefill[i]._arrive(first)

    def poke(self) -> None:
        for s in self.prefill + self.decode:
            s.poke()

    def models_skew(self) -> bool:
        return all(s.models_skew() for s in self.prefill + self.decode)

    def _may_fail(self, request_id: str) -> bool:
        # a handoff still on the prefill side fails when its lease runs out under policy fail
        h = self.machine.handoffs.get(request_id)
        return self.layout.kv_load_failure_policy == "fail" and h is not None and h.state in ("pending", "writing")

    def _prefilled(self, i: int, first: Request, t: _Track, now: float) -> None:
        """Prefill instance ``i`` sampled ``first``'s token: the client has it; its KV waits for room."""
        r = self.requests[first.request_id]
        mine = self.track[r.request_id]
        mine.first_scheduled_s, mine.first_token_s, mine.compute_s = t.first_scheduled_s, now, t.compute_s
        if r.append_token(first.output_token_ids[-1]):  # one output token: nothing to hand over
            self.machine.prefill[i].end(r.request_id)
            self.prefill[i].poke()
            self._record(r, mine, now)
            return
        rd = Request(r.request_id, r.prompt_token_ids, r.params, r.arrival_s, output_token_ids=list(r.output_token_ids))
        self.machine.prefilled(i, r, rd, now)
        self.tracks[r.request_id] = _Track(r.arrival_s, t.first_scheduled_s, now, t.compute_s)
        self.loop.timer(now + self.layout.kv_lease_s, self._lease_check, r.request_id)
        self._place()

    def _place(self) -> None:
        """Every waiting handoff that finds decode room now starts its copies, oldest first."""
        now = self.loop.now
        for h in list(self.machine.handoffs.values()):
            if h.state == "pending":
                self.machine.start(h, now)

    def _copied_out(self, rid: str) -> None:
        """The prefill side's copy is done (in place: none was made); the copy in starts."""
        h = self.machine.handoffs.get(rid)
        if h is None:  # given up while its copy ran (its lease ran out)
            return
        self.machine.copied_out(h, True, self.loop.now)
        self.prefill[h.prefill].poke()

    def _landed(self, rid: str) -> None:
        h = self.machine.handoffs.get(rid)
        if h is None:
            return
        self.machine.copied_in(h, True, self.loop.now)
        self.handoff_s[rid] = self.loop.now - h.started_s
        d = self.decode[h.decode]
        d.track[rid] = self.tracks.pop(rid)  # its first token is known: the decode side only adds the rest
        d.poke()
        self.prefill[h.prefill].poke()  # in place, its lease ended only now

    def _lease_check(self, rid: str) -> None:
        """Its lease ran out: a handoff still on the prefill side is given up, as the engine does."""
        h = self.machine.handoffs.get(rid)
        if h is None or h.state not in ("pending", "writing"):  # it left the prefill side in time
            return
        self._given_up(self.machine.expire(h))
        self.prefill[h.prefill].poke()

    def _given_up(self, g: GivenUp) -> None:
        rid, track = g.handoff.request_id, self.tracks.pop(g.handoff.request_id)
        if g.recompute_on is None:
            self.requests.pop(rid)
            self.track.pop(rid)
            self._pending -= 1
            self.num_failed += 1  # no record: it counts among the point's failed requests
            return
        # recompute: a decode instance prefills the prompt and the first token again
        r = self.requests[rid]
        rd = Request(rid, list(r.prompt_token_ids) + list(r.output_token_ids), SamplingParams(
            max_tokens=r.params.max_tokens - len(r.output_token_ids), ignore_eos=True), r.arrival_s)
        self.machine.stats.recomputes += 1
        self.decode[g.recompute_on].track[rid] = track
        self.decode[g.recompute_on].add(rd)

    def _decoded(self, rd: Request, t: _Track, now: float) -> None:
        r = self.requests[rd.request_id]
        n = len(rd.output_token_ids) if rd.num_prompt_tokens == r.num_prompt_tokens else \
            len(r.output_token_ids) + len(rd.output_token_ids)  # recomputed: its prompt held the first token
        self._record(r, self.track[r.request_id], now, n, self.handoff_s.pop(r.request_id, None))
        self._place()

    def _record(self, r: Request, t: _Track, now: float, num_output: int = 1, handoff_s: float | None = None) -> None:
        del self.requests[r.request_id], self.track[r.request_id]
        self.records.append(RequestRecord(r.num_prompt_tokens, t.arrival_s, t.first_scheduled_s, t.first_token_s,
                                          t.compute_s, now, num_output, handoff_s))
        self._pending -= 1

    def totals(self):
        busy_s, entities, split_s, preemptions = {}, {}, {}, 0
        for side, systems in (("prefill", self.prefill), ("decode", self.decode)):
            for s in systems:
                b, e, p, sp = s.totals()
                preemptions += p
                for role in e:
                    busy_s[f"{side}.{role}"] = busy_s.get(f"{side}.{role}", 0.0) + b.get(role, 0.0)
                    entities[f"{side}.{role}"] = entities.get(f"{side}.{role}", 0) + e[role]
        return busy_s, entities, preemptions, split_s
