"""Mode ``pd``: prefill instances hand each request's KV cache to decode instances (xPyD).

Each instance is a whole engine of its own layout (built by the mode table's ``create_engine``);
this engine routes requests and moves their KV. A request runs on the least-loaded prefill
instance with ``max_tokens=1``; its blocks stay leased there when its first token is sampled (the
client sees that token at once). Then: decode room found (the instance with the most free KV,
blocks pre-allocated there) -> the decode members copy the leased blocks straight out of the
prefill members' caches (shared memory, or CUDA IPC: one copy; ``share_kv_cache``) into the
reserved blocks -> the lease ends and the request decodes there. A handoff
that fails, or whose lease runs out waiting for decode room, fails the request or is recomputed
on a decode instance (``kv_load_failure_policy``). ``docs/pd.md`` has the diagram and the table.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Callable

from moeflow.config import ConfigError, EngineConfig
from moeflow.core import EngineBusy, Request, RequestError, RequestStatus
from moeflow.engine.base import Engine, EngineLoad, StepResult, clock, validate_request
from moeflow.engine.kv_handoff import KvConnector, heap_device
from moeflow.engine.pd_driver import Arrived, Ended, HandoffDriver
from moeflow.engine.pd_members import PdMembers, check_compatible
from moeflow.layout import PdLayout
from moeflow.scheduler.handoff.deployment import GivenUp

_SUB_WAIT_S = 2e-3  # an instance's step blocks at most this long: the others are stepped in turn


class HandoffsFull(EngineBusy):
    """Too many prefilled requests wait for decode room (the server answers 503, Retry-After)."""


class PdEngine(Engine):
    mode_name = "pd"
    multinode = False
    # the mode table's create_engine (engine/modes.py sets it: the modes never import the table)
    build_instance: Callable[..., Engine] | None = None

    def __init__(self, model_path: str, config: EngineConfig, layout: PdLayout):
        self.config, self.layout, self.model_path = config, layout, model_path
        self.prefill: list[Engine] = []
        self.decode: list[Engine] = []
        self.kv: KvConnector | None = None
        try:
            self.prefill = [self._instance(layout.prefill) for _ in range(layout.prefill_instances)]
            self.decode = [self._instance(layout.decode) for _ in range(layout.decode_instances)]
            first = self.prefill[0]
            self.model_config, self.max_model_len = first.model_config, min(e.max_model_len for e in self.instances)
            for e in self.decode:  # one deployment builds both from one model; separate servers may not
                check_compatible(first, e)
            mc = self.model_config
            # every prefill group's caches shared: the decode members read them in place, no staging heap
            in_place = all(p.handoff_port().regions(0) is not None for p in self.prefill)
            # NOTE: <pid>-<hex>, as an engine's: a SIGKILLed owner's arena is reclaimed by the next one
            self.kv = KvConnector.for_model(f"{os.getpid()}-{uuid.uuid4().hex[:8]}", mc, self.max_model_len,
                                            config.dtype, layout.kv_buffer_mib, heap_device(config), not in_place)
        except BaseException:
            self.shutdown()
            raise
        self.requests: dict[str, Request] = {}  # the client's requests, unfinished
        self.where: dict[str, tuple[str, int]] = {}  # request id -> ("prefill" | "decode", instance)
        self.handoff_s: dict[str, float] = {}  # arrived on a decode instance, no output there yet: its handoff
        self.driver = HandoffDriver(self.prefill, self.decode, self.kv, layout, config.seed, config.trace)
        self.machine = self.driver.machine  # the handoffs' state machine (scheduler/handoff/deployment.py)
        self.handoffs = self.machine.handoffs  # request id -> its handoff, oldest first
        self.members = PdMembers(self)  # instances that join and leave while serving

    def _instance(self, layout) -> Engine:
        e = PdEngine.build_instance(layout, self.model_path, dataclasses.replace(self.config, share_kv_cache=True))
        e.max_wait_s = _SUB_WAIT_S
        return e

    @property
    def instances(self) -> list[Engine]:
        return self.prefill + self.decode

    # -- intake -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        validate_request(request, self.model_config)
        if request.request_id in self.requests:
            raise RequestError(f"request {request.request_id}: a request with this id is running")
        need = self.kv.bytes_for(request.num_prompt_tokens)
        if self.kv.staged and need > self.kv.heap.size_bytes:
            raise RequestError(f"request {request.request_id}: its prompt's KV ({need / 2**20:.1f} MiB) exceeds the "
                               f"handoff buffer ({self.kv.heap.size_bytes / 2**20:.1f} MiB, kv_buffer_mib)")
        if len(self.handoffs) >= self.layout.max_pending_handoffs:
            raise HandoffsFull(f"{len(self.handoffs)} prefilled requests wait for decode room "
                               f"(max_pending_handoffs); retry later")
        live = [i for i, e in enumerate(self.prefill[:self.members.serving("prefill")]) if e.failed is None]
        if not live:
            raise RequestError("every prefill instance has failed")
        i = min(live, key=lambda i: _busy(self.prefill[i]))
        p = request.params
        first = Request(request.request_id, request.prompt_token_ids,
                        dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1)), request.arrival_s,
                        eos_token_ids=request.eos_token_ids, kv_handoff=True)
        self.prefill[i].add_request(first)
        self.requests[request.request_id] = request
        self.where[request.request_id] = ("prefill", i)

    def abort(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        side, i = self.where.pop(request_id, (None, 0))
        h = self.handoffs.get(request_id)
        self.handoff_s.pop(request_id, None)
        if h is not None:
            self.machine.drop(h)
        elif side == "prefill":
            self.prefill[i].abort(request_id)
            self.machine.prefill[i].end(request_id)
        elif side == "decode":
            self.decode[i].abort(request_id)
        if r is not None:
            r.status, r.finish_reason = RequestStatus.FINISHED, r.finish_reason or "abort"

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        # NOTE: decode first: a request that arrives on a decode instance in this step decodes in the
        # next one, so its prefill output (first token, prompt logprobs) and its first decode output
        # never meet in one StepResult (one output per request per step)
        result = StepResult({}, [])
        for e in self.decode:
            if e.failed is None:
                self._decoded(e.step(), result)
        for i, e in enumerate(self.prefill):
            if e.failed is None:
                self._prefilled(i, e.step(), result)
        self._advance(result)
        self.members.turn()
        return result

    def scale(self, prefill: int | None = None, decode: int | None = None, **other) -> dict:
        """Ask for ``prefill`` or ``decode`` instances, one side at a time (``pd_members.py``)."""
        return self.members.scale(prefill, decode, other)

    def scale_status(self) -> dict:
        return self.members.status()

    def _prefilled(self, i: int, res: StepResult, out: StepResult) -> None:
        out.busy_s.update({f"prefill{i}.{k}": v for k, v in res.busy_s.items()})
        for rid, o in res.outputs.items():
            r = self.requests.get(rid)
            if r is not None:
                out.outputs[rid] = o
                if o.token_id is not None:
                    r.append_token(o.token_id)
        side = self.machine.prefill[i]
        for rp in res.finished:
            r = self.requests.get(rp.request_id)
            if r is None or rp.finish_reason in ("abort", "error") or r.finish_reason is not None:
                side.end(rp.request_id)
                if r is not None:
                    self._finish(r, out, rp.error, rp.finish_reason if r.finish_reason is None else None)
                continue
            rd = Request(r.request_id, r.prompt_token_ids, r.params, r.arrival_s, eos_token_ids=r.eos_token_ids,
                         output_token_ids=list(r.output_token_ids))
            self.machine.prefilled(i, r, rd, clock())
            self.where.pop(r.request_id, None)

    # -- the handoffs (pd_driver.py) ---------------------------------------------------------------

    def _advance(self, out: StepResult) -> None:
        for o in self.driver.advance(out):
            if isinstance(o, Arrived):
                self.handoff_s[o.request_id] = o.seconds  # goes out with its first decode output
                self.where[o.request_id] = ("decode", o.decode)
            elif isinstance(o, Ended):
                ended = StepResult({}, o.finished)
                self._decoded(ended, out) if o.side == "decode" else self._prefilled(o.instance, ended, out)
            else:
                self._given_up(o, out)

    def _given_up(self, g: GivenUp, out: StepResult) -> None:
        """The policy's answer for a handoff given up: recompute its prompt on a decode instance
        (from the prompt and the first token), or fail the request."""
        rid, why = g.handoff.request_id, g.why
        if g.recompute_on is not None:
            try:
                self.decode[g.recompute_on].add_request(g.handoff.decode_request)
                self.machine.stats.recomputes += 1
                self.where[rid] = ("decode", g.recompute_on)
                return
            except Exception as e:  # noqa: BLE001  (then the request fails with both reasons)
                why += f"; recomputing it failed: {e}"
        self._finish(g.handoff.request, out, f"request {rid}: {why}", "error")

    def _decoded(self, res: StepResult, out: StepResult) -> None:
        for rid, o in res.outputs.items():
            r = self.requests.get(rid)
            if r is not None and o.token_id is not None and r.finish_reason is None:
                o.handoff_s = self.handoff_s.pop(rid, None)
                out.outputs[rid] = o
                if r.append_token(o.token_id):  # a stop string, which only the client's request tracks
                    side, j = self.where[rid]
                    self.decode[j].abort(rid)
                    self._finish(r, out)
        for rd in res.finished:
            r = self.requests.get(rd.request_id)
            if r is not None:
                self._finish(r, out, rd.error, rd.finish_reason if r.finish_reason is None else None)

    def _finish(self, r: Request, out: StepResult, error: str | None = None, reason: str | None = None) -> None:
        if reason is not None:
            r.finish_reason = reason
        r.error = r.error or error
        r.status = RequestStatus.FINISHED
        self.requests.pop(r.request_id, None)
        self.where.pop(r.request_id, None)
        self.handoff_s.pop(r.request_id, None)
        out.finished.append(r)

    # -- the deployment -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        loads = [e.load() for e in self.instances if e.failed is None]
        side = {"prefill": 0, "decode": 0}
        for s, _ in self.where.values():
            side[s] += 1
        st = self.kv.stats
        return EngineLoad(sum(x.num_waiting for x in loads), sum(x.num_running for x in loads),
                          sum(x.num_free_kv_blocks for x in loads), sum(x.num_kv_blocks for x in loads),
                          tuple(n for x in loads for n in x.running_per_group),
                          tuple(n for x in loads for n in x.preemptions_per_group), tuple(side.items()),
                          len(self.handoffs), (("failures", st.failures), ("lease_expiries", st.lease_expiries),
                                               ("recomputes", st.recomputes)), degraded=self._lost(),
                          members=tuple((side, self.members.serving(side)) for side in ("prefill", "decode")),
                          scale_events=self.members.counts())

    def _lost(self) -> str | None:
        lost = [f"{side} instance {i} failed ({e.failed})" for side, es in (("prefill", self.prefill),
                                                                           ("decode", self.decode))
                for i, e in enumerate(es) if e.failed is not None]
        return "; ".join(lost) or None

    def check_workers(self) -> StepResult:
        out = StepResult({}, [])
        for side, engines in (("prefill", self.prefill), ("decode", self.decode)):
            for e in engines:
                if e.failed is None:
                    res = e.check_workers()
                    (self._decoded(res, out) if side == "decode" else self._prefilled(engines.index(e), res, out))
        self._advance(out)
        self.members.turn()  # a change goes on while the deployment is idle (the server steps it no more)
        return out


    def heal(self) -> bool:
        """Rebuild every failed instance in place; the others go on serving."""
        for side, layout in (("prefill", self.layout.prefill), ("decode", self.layout.decode)):
            engines = getattr(self, side)
            for i, e in enumerate(engines):
                if e.failed is not None:
                    e.shutdown()
                    self.kv.drain(gone=True)
                    engines[i] = self._instance(layout)
                    self.driver.rebuilt(side, i)
        return True

    def drain(self, timeout_s: float = 120.0) -> None:
        for e in self.instances:
            e.drain(timeout_s)

    def collect_spans(self) -> list:
        """Every instance's worker spans, each track under its side ("prefill0:attention0/main"), and
        the handoffs' own track between them."""
        out = []
        for side, engines in (("prefill", self.prefill), ("decode", self.decode)):
            for i, e in enumerate(engines):
                if getattr(e, "failed", None) is not None:  # its workers are gone, and their spans with them
                    continue
                try:
                    spans = e.collect_spans()
                except ConfigError:  # an in-process instance (colocated) records none
                    continue
                out += [dataclasses.replace(s, track=f"{side}{i}:{s.track}") for s in spans]
        out, self.driver.spans = out + self.driver.spans, []
        return out

    def shutdown(self) -> None:
        if getattr(self, "members", None) is not None:
            self.members.shutdown()
        for e in self.instances:
            e.shutdown()
        if self.kv is not None:
            self.kv.shutdown()


def _busy(e: Engine) -> int:
    x = e.load()
    return x.num_waiting + x.num_running

