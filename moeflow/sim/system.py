"""One simulated deployment: its layout, and the bookkeeping every mode shares.

A ``System`` owns the event loop of one run: it feeds workload arrivals to the engine's own
scheduler (imported unchanged from ``moeflow.scheduler``), prices each stage with the cost model,
and records per-request times in ``bench serve``'s ``RequestRecord`` form.
"""
from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field

from moeflow.core import Batch, Request, SamplingParams
from moeflow.experiment.system import SystemSpec
from moeflow.measure.metrics import RequestRecord, mean_ttft_lower_bound
from moeflow.measure.slo import StopRule
from moeflow.scheduler.handoff.port import KvPort
from moeflow.measure.workload import WorkloadRequest
from moeflow.messages import Span
from moeflow.scheduler import Scheduler, make_scheduler
from moeflow.scheduler.load_window import oldest_unanswered
from moeflow.sim.cores import CorePool
from moeflow.sim.cost import CostModel
from moeflow.sim.events import EventLoop
from moeflow.sim.expert_load import ExpertLoads
from moeflow.sim.hardware import between, hardware_preset
from moeflow.sim.jitter import Jitter


@dataclass
class RunResult:
    records: list[RequestRecord]
    num_events: int
    end_s: float
    stopped_early: bool = False
    mean_ttft_bound_s: float | None = None  # set when stopped early
    spans: list[Span] = field(default_factory=list)
    busy: dict[str, float] = field(default_factory=dict)  # per role: mean fraction of the run spent computing
    num_pending: int = 0  # requests without a result when the run stopped early
    expert_imbalance: float | None = None  # skewed expert loads: mean (most loaded device / mean) per layer
    preemptions: int = 0  # requests the scheduler preempted by recompute (KV blocks on demand)
    # step systems that keep one (dep): per kind, the mean fraction of the run an entity's steps spent
    split: dict[str, float] = field(default_factory=dict)
    num_failed: int = 0  # requests that ended without a result (pd: a lease ran out under policy fail)
    process_s: float | None = None  # an elastic system: members x seconds (None: every process all along)
    changes: list = field(default_factory=list)  # an elastic system's membership changes
    windows: list = field(default_factory=list)  # and the load windows its controller saw (Sample's fields)


@dataclass
class _Track:
    """Per request: what the records need beyond the scheduler's Request."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    compute_s: float = 0.0
    max_tokens: int = 0  # its output tokens at most (0: not known here)


_NO_LIMIT = 1 << 40  # max_model_len None: the simulator caps nothing


class System(abc.ABC):
    """One simulated deployment of ``spec``: its layout, the engine's KV and sequence limits, and
    the simulator's modelling options."""

    lands_handed_kv = False  # sim.decode_side: requests may arrive with their prompt's KV (step_system.py)

    def __init__(self, spec: SystemSpec, cost: CostModel, trace_until_s: float = 0.0):
        # a role on hardware of its own (spec.hardware) is priced on its preset, the same options applied
        if spec.hardware_of("all"):
            cost = cost.on(hardware_preset(spec.hardware_of("all")))
        self.role_costs = {role: cost.on(hardware_preset(name)).for_system(spec.sim)
                           for role, name in spec.hardware if role != "all"}
        self._links: dict[tuple[str, str], CostModel] = {}  # link_cost's, per pair of roles
        cost = cost.for_system(spec.sim)
        self.spec, self.layout, self.cost, self.model = spec, spec.layout, cost, cost.model
        self.loads: ExpertLoads | None = None  # set by systems with expert devices
        cv = spec.sim.compute_jitter_cv
        self.jitter = Jitter(cost.compute_jitter_cv if cv is None else cv, spec.sim.seed)
        self.loop = EventLoop()
        self.trace_until_s = trace_until_s  # record spans that start before this time (0: none)
        self.spans: list[Span] = []
        self.records: list[RequestRecord] = []
        self.track: dict[str, _Track] = {}
        self.handed: deque[Request] = deque()  # arrived with their KV, waiting for room (sim.decode_side)
        self._pending = 0
        self.busy_s: dict[str, float] = {}  # per role: compute seconds summed over its entities
        self.num_entities: dict[str, int] = {}
        self.cores = self.core_pool(self.layout.num_processes)

    def core_pool(self, processes: int) -> CorePool | None:
        """The machine's cores as a calendar, where ``processes`` (the most the deployment runs at once:
        an elastic one's budget) outnumber them; None: every process computes on a core of its own."""
        cores = self.cost.shared_cores
        return CorePool(cores) if self.spec.sim.core_sharing and cores and processes > cores else None

    def cost_of(self, role: str) -> CostModel:
        """The cost model of ``role``'s devices (the deployment's unless the spec gives the role its own)."""
        return self.role_costs.get(role, self.cost)

    def link_cost(self, a: str, b: str) -> CostModel:
        """The cost model of what crosses from role ``a`` to role ``b``: over the scale-out network
        when their hardware differs (sim/hardware.between), else ``a``'s own links."""
        if (a, b) not in self._links:  # NOTE: asked every step (afd) and handoff (pd): built once
            ca, cb = self.cost_of(a), self.cost_of(b)
            self._links[a, b] = ca if ca is cb else ca.on(between(ca.hw, cb.hw))
        return self._links[a, b]

    def finish_at(self, ready_s: float, dur_s: float, processes: int = 1) -> float:
        """When ``processes`` (a TP group: each computes ``dur_s``) ready at ``ready_s`` have all
        finished: later than ``ready_s + dur_s`` only while every core is taken (sim/cores.py)."""
        if self.cores is None:
            return ready_s + dur_s
        return max(self.cores.reserve(ready_s, dur_s, self.loop.now) for _ in range(processes)) + dur_s

    def _scheduler(self) -> Scheduler:
        """The engine's scheduler for this layout, built as the engine builds it."""
        e = self.spec.engine
        return make_scheduler(self.layout, e, e.max_model_len or _NO_LIMIT)

    def span(self, track: str, name: str, start_s: float, end_s: float) -> None:
        if start_s < self.trace_until_s and end_s > start_s:
            self.spans.append(Span(name, track, start_s, end_s))

    # roles of busy_s that are not processes computing (a thread's copies, time spent waiting)
    not_processes: frozenset[str] = frozenset()

    def compute_s(self) -> float:
        """Compute seconds so far, summed over the processes (what an engine's workers report as busy)."""
        return sum(v for k, v in self.totals()[0].items() if k not in self.not_processes)

    num_failed = 0  # requests failed on purpose (they have no record and are not pending)
    stop_check_every = 4096  # events between a stop rule's checks (each walks every request)
    # where finished requests go: None, this system's records; a composition (sim/pd.py) takes them
    # itself, as ``sink(request, its track, now)``
    sink = None

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """A request arrives now (``self.loop.now``)."""

    @abc.abstractmethod
    def poke(self) -> None:
        """Something outside the scheduler changed its pool (KV freed, a request arrived with its
        KV): schedule again now if idle."""

    def totals(self) -> tuple[dict[str, float], dict[str, int], int, dict[str, float]]:
        """Compute seconds and entities per role, preemptions, and the step split's seconds."""
        return self.busy_s, self.num_entities, self.sched.pool.num_preemptions, getattr(self, "split_s", {})

    def run(self, workload: list[WorkloadRequest], stop: StopRule | None = None) -> RunResult:
        """Replay ``workload`` to the end (or until it has certainly missed ``stop``'s SLO)."""
        if self.spec.sim.decode_side and not self.lands_handed_kv:
            raise ValueError(f"system {self.spec.name!r}: sim.decode_side (requests arriving with their KV) is "
                             f"modelled for dep and afd, not mode {self.layout.mode!r}")
        if self.spec.sim.expert_load_cv and not self.models_skew():
            raise ValueError(f"system {self.spec.name!r}: mode {self.layout.mode!r} does not model expert-load "
                             f"skew (sim.expert_load_cv); the modes that do: dep, asap")
        for i, w in enumerate(workload):
            # NOTE: a range stands in for the prompt's token ids: the scheduler only counts them.
            r = Request(f"r{i}", range(w.prompt_len), SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                        arrival_s=w.arrival_s)
            self.loop.at(w.arrival_s, self._arrive, r)
        self._pending = len(workload)
        n = len(workload)
        self.loop.run(None if stop is None else (lambda: stop.fails(
            *self._progress(), n, self.loop.now, self._tpot_lower() if stop.tpot is not None else None)),
            every=self.stop_check_every)
        stopped = self._pending > 0
        if stopped and stop is None:  # nothing left to happen, yet requests wait: a scheduler that never admits them
            raise RuntimeError(f"system {self.spec.name!r}: the simulation ran out of events at {self.loop.now:.1f} s "
                               f"with {self._pending} requests unfinished")
        end = self.loop.now
        busy_s, num_entities, preemptions, split_s = self.totals()
        busy = {role: s / (num_entities[role] * end) if end > 0 else 0.0 for role, s in busy_s.items()}
        bound = mean_ttft_lower_bound(*self._progress(), n, end) if stopped else None
        imbalance = self.loads.mean_imbalance if self.loads is not None and not self.loads.balanced else None
        entities = sum(num_entities.values())
        split = {k: v / (entities * end) for k, v in split_s.items()} if end > 0 else {}
        return RunResult(self.records, self.loop.num_events, end, stopped, bound, self.spans, busy, self._pending,
                         imbalance, preemptions, split, self.num_failed)

    def models_skew(self) -> bool:
        return self.loads is not None

    def kv_blocks(self) -> tuple[int, int]:
        """(free, all) KV blocks of its groups (an engine's ``load()`` reports the same)."""
        groups = self.sched.pool.groups
        return sum(g.allocator.num_free for g in groups), sum(g.allocator.num_blocks for g in groups)

    def oldest_unanswered_s(self) -> float | None:
        """The arrival of its oldest request without a first token (``scheduler/load_window``)."""
        return oldest_unanswered(self.sched.pool)

    def handoff_port(self) -> KvPort:
        """What a KV handoff's side may do to this system (the engine's ``Engine.handoff_port``)."""
        return KvPort(self.sched.pool)

    def expert_loads(self, num_devices: int) -> ExpertLoads:
        """The expert-load model of this system's ``num_devices`` expert devices (SimOptions)."""
        sim, m = self.spec.sim, self.model
        cv = m.gate_load_cv if sim.expert_load_cv is None else sim.expert_load_cv
        return ExpertLoads(m.num_experts, m.num_moe_layers, num_devices, cv, sim.expert_placement, sim.expert_seed,
                           getattr(self.spec.layout, "num_redundant_experts", 0))

    def _progress(self) -> tuple[list[float], list[float]]:
        """TTFTs so far, and the arrival times of requests still waiting for a first token."""
        now = self.loop.now
        done = [r.ttft_s for r in self.records]
        done += [t.first_token_s - t.arrival_s for t in self.track.values() if t.first_token_s is not None]
        waiting = [t.arrival_s for t in self.track.values() if t.arrival_s <= now and t.first_token_s is None]
        return done, waiting

    def _tpot_lower(self) -> list[float]:
        """A lower bound of the TPOT of every request with two or more output tokens that is certain
        to complete: a finished one's own; one past its first token: its time since then over its
        output tokens after the first (it stops at ``max_tokens`` or earlier, which only raises it)."""
        now = self.loop.now
        out = [t for r in self.records if (t := r.tpot_s) is not None and t > 0]
        out += [(now - t.first_token_s) / (t.max_tokens - 1) for rid, t in self.track.items()
                if t.first_token_s is not None and t.max_tokens > 1 and not self._may_fail(rid)]
        return out

    def _may_fail(self, request_id: str) -> bool:
        """Whether a request past its first token may still end without a record (not here)."""
        return False

    def _arrive(self, r: Request) -> None:
        self.track[r.request_id] = _Track(r.arrival_s, max_tokens=r.params.max_tokens)
        self.add(r)

    def started(self, request_ids, compute_s: float, now: float) -> None:
        """Requests in a batch that started at ``now`` and will compute ``compute_s`` of it."""
        for rid in request_ids:
            t = self.track.get(rid)
            if t is None:
                continue
            if t.first_scheduled_s is None:
                t.first_scheduled_s = now
            if t.first_token_s is None:  # the records' compute is what the first token took
                t.compute_s += compute_s

    def sampled(self, batch: Batch, finished: list[Request], now: float) -> None:
        """A batch's tokens were sampled at ``now``; ``finished``: the requests it completed."""
        for s in batch.seqs:
            t = self.track.get(s.request_id)
            if t is not None and s.is_last_chunk and t.first_token_s is None:
                t.first_token_s = now
        for r in finished:
            t = self.track.pop(r.request_id)
            if self.sink is not None:
                self.sink(r, t, now)
                continue
            self.records.append(RequestRecord(r.num_prompt_tokens, t.arrival_s, t.first_scheduled_s,
                                              t.first_token_s, t.compute_s, now, len(r.output_token_ids)))
            self._pending -= 1
