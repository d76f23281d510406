"""A prefill/decode-disaggregated deployment (``PdLayout``) as the engine's mode ``pd`` runs it.

X prefill instances and Y decode instances, each a whole simulated system of its own layout (any
simulated mode, built by ``make_system``), on one event loop. A request runs on the prefill
instance with the fewest unfinished requests with ``max_tokens=1``; its first token is the
client's (TTFT, as the one-command deployment streams it) and its blocks stay leased there. Then,
oldest first, each prefilled request waits for decode room (the decode instance and group with the
most free KV blocks, blocks reserved: the pre-allocation queue); the copy out of the prefill
instance ends the lease, the copy in lands the KV, and the request decodes there. A request that
waits longer than ``kv_lease_s`` gives its blocks up: ``recompute`` prefills its prompt again on a
decode instance, ``fail`` fails it (a failed request of the point). The staging buffer's size
(``kv_buffer_mib``) is not modelled: every handoff that found decode room copies at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from moeflow.core import Request, SamplingParams
from moeflow.measure.metrics import RequestRecord
from moeflow.scheduler.handoff import Arrivals, most_room
from moeflow.sim.system import System, _Track


@dataclass
class _Handoff:
    request: Request  # the decode side's: the prompt and the first token
    prefill: int
    prefilled_s: float
    track: _Track  # arrival, first batch, first token and compute so far
    decode: int | None = None
    started_s: float | None = None


class PdSystem(System):
    def __init__(self, spec, cost, trace_until_s=0.0, make_system=None):
        super().__init__(spec, cost, trace_until_s)
        lay = spec.layout
        self.prefill = [self._instance(make_system, lay.prefill, f"prefill{i}", partial(self._prefilled, i))
                        for i in range(lay.prefill_instances)]
        self.decode = [self._instance(make_system, lay.decode, f"decode{j}", self._decoded)
                       for j in range(lay.decode_instances)]
        self.arrivals = [Arrivals(d.sched.pool) for d in self.decode]
        self.requests: dict[str, Request] = {}  # the client's, until it finishes
        self.waiting: dict[str, _Handoff] = {}  # prefilled, no decode room yet (oldest first)
        self.handoff_s: dict[str, float] = {}  # landed on a decode instance: its handoff's seconds
        m = self.model
        self.kv_bytes_per_token = m.kv_bytes_per_token_layer * m.num_layers
        self.lease_expiries = 0

    def _instance(self, make_system, layout, name: str, sink) -> System:
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}.{name}", layout=layout)
        s = make_system(spec, self.cost)
        # one clock for the deployment, one pool of cores for all its processes; finished requests come here
        s.loop, s.cores, s.sink = self.loop, self.cores, sink
        return s

    def add(self, request: Request) -> None:
        i = min(range(len(self.prefill)), key=lambda i: (len(self.prefill[i].track), i))
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
        # a handoff still waiting for decode room fails when its lease runs out under policy fail
        return self.layout.kv_load_failure_policy == "fail" and request_id in self.waiting

    def _prefilled(self, i: int, first: Request, t: _Track, now: float) -> None:
        """Prefill instance ``i`` sampled ``first``'s token: the client has it; its KV waits for room."""
        r = self.requests[first.request_id]
        mine = self.track[r.request_id]
        mine.first_scheduled_s, mine.first_token_s, mine.compute_s = t.first_scheduled_s, now, t.compute_s
        if r.append_token(first.output_token_ids[-1]):  # one output token: nothing to hand over
            self.prefill[i].sched.pool.end_lease(r.request_id)
            self.prefill[i].poke()
            self._record(r, mine, now)
            return
        rd = Request(r.request_id, r.prompt_token_ids, r.params, r.arrival_s, output_token_ids=list(r.output_token_ids))
        self.waiting[r.request_id] = _Handoff(rd, i, now, _Track(r.arrival_s, t.first_scheduled_s, now, t.compute_s))
        self.loop.timer(now + self.layout.kv_lease_s, self._lease_check, r.request_id)
        self._place()

    def _place(self) -> None:
        """Every waiting handoff that finds decode room now starts its copies, oldest first."""
        now = self.loop.now
        for rid, h in list(self.waiting.items()):
            best = most_room(self.arrivals, h.request)  # the engine's choice (engine/handoffs.py)
            if best is None:
                continue
            j, gid = best
            del self.waiting[rid]
            self.arrivals[j].reserve(gid, h.request)
            h.decode, h.started_s = j, now
            out_s, in_s = self.cost.kv_handoff_s(h.request.num_prompt_tokens * self.kv_bytes_per_token)
            self.loop.at(now + out_s, self._copied_out, h, in_s)

    def _copied_out(self, h: _Handoff, in_s: float) -> None:
        """The prefill side's copy is done: its lease ends, its blocks go back."""
        p = self.prefill[h.prefill]
        p.sched.pool.end_lease(h.request.request_id)
        p.poke()
        self.loop.at(self.loop.now + in_s, self._landed, h)

    def _landed(self, h: _Handoff) -> None:
        rid = h.request.request_id
        d = self.decode[h.decode]
        self.arrivals[h.decode].arrive(h.request)
        self.handoff_s[rid] = self.loop.now - h.started_s
        d.track[rid] = h.track  # its first token is known: the decode side only adds the rest
        d.poke()

    def _lease_check(self, rid: str) -> None:
        h = self.waiting.pop(rid, None)
        if h is None:  # it found room in time
            return
        self.lease_expiries += 1
        p = self.prefill[h.prefill]
        p.sched.pool.end_lease(rid)
        p.poke()
        if self.layout.kv_load_failure_policy == "fail":
            self.requests.pop(rid)
            self.track.pop(rid)
            self._pending -= 1
            self.num_failed += 1  # no record: it counts among the point's failed requests
            return
        # recompute: a decode instance prefills the prompt and the first token again
        r = self.requests[rid]
        j = min(range(len(self.decode)), key=lambda j: (len(self.decode[j].track), j))
        rd = Request(rid, list(r.prompt_token_ids) + list(r.output_token_ids), SamplingParams(
            max_tokens=r.params.max_tokens - len(r.output_token_ids), ignore_eos=True), r.arrival_s)
        self.decode[j].track[rid] = h.track
        self.decode[j].add(rd)

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
