"""DWDP as the engine runs it: ``DwdpScheduler`` gives each idle rank its next batch; a rank runs
every layer itself, its lacking experts pulled one MoE layer ahead into a two-slot buffer.

Per rank, a copy engine works through the MoE layers in the order every pass visits them (one pull
per MoE layer, endlessly): pull k starts once the copy engine is free and its slot was released
(the experts of pull k-2 have run), and lasts the transfer of the lacking experts' bytes over the
rank's NVLink, stretched by source contention (``contention.py``): the engine's own copy plan
(``scheduler/copy_plan.py``) says which peer serves which bytes; a ``naive`` plan pulls source
after source, each pull at a drawn contention level, a ``sliced`` plan pays the mean factor of two
slices in flight. A layer's experts start when both its attention is done and its pull is in
(with ``merge``, after a device copy of every expert into one buffer, DWDP §4.2's ablation): per
layer max(compute, prefetch) in steady state, as DWDP models it. Ranks never wait for one
another's work (only, with more ranks than the machine's cores, for a core: sim/cores.py); one
event per batch (its layer timeline has a closed form).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moeflow.core import Request
from moeflow.scheduler.copy_plan import copy_plan
from moeflow.sim.contention import ContentionDraws, expected_slowdown
from moeflow.sim.memory import GIB, most_resident_experts
from moeflow.sim.shape import AttnShape
from moeflow.sim.system import System


def resident_by_memory(spec, cost) -> int:
    """Experts per layer a rank of ``spec`` holds when it fills its memory budget (sim.resident_experts)."""
    e = spec.engine
    if e.memory_budget_gib is None:
        raise ValueError(f"system {spec.name!r}: sim.resident_experts memory needs engine.memory_budget_gib")
    hbm = getattr(getattr(cost, "hw", None), "hbm_bytes", 0.0)
    return most_resident_experts(cost.model, spec.layout, e.memory_budget_gib * GIB, spec.layout.max_batch_tokens,
                                 e.max_num_seqs, hbm)


def unit_bytes(model) -> dict[str, int]:
    """One expert's tensors as the copy plan sees them: gate+up (2F x H) and down (H x F)."""
    return {"w13": round(model.expert_bytes * 2 / 3), "w2": round(model.expert_bytes / 3)}


class DwdpSystem(System):
    not_processes = frozenset({"copy_engine", "pull_wait"})  # a rank's copy thread, and its waits on it
    fast = True  # False: every batch's layers through the general loop (``_layers_on_cores``): the oracle

    def __init__(self, spec, cost, trace_until_s=0.0):
        if spec.sim.resident_experts == "memory":
            spec = dataclasses.replace(spec, layout=dataclasses.replace(
                spec.layout, experts_per_rank=resident_by_memory(spec, cost)))
        super().__init__(spec, cost, trace_until_s)
        layout, m = spec.layout, cost.model
        self.sched = self._scheduler()
        placement = layout.experts_held(m.num_experts)
        n = layout.dp
        # per rank: the bytes each source serves it per MoE layer, in the plan's order
        self.by_source: list[dict[int, int]] = []
        for r in range(n):
            per: dict[int, int] = {}
            for s in copy_plan(placement, r, m.num_experts, unit_bytes(m), layout.copy_plan, layout.slice_bytes):
                per[s.src] = per.get(s.src, 0) + s.nbytes
            self.by_source.append(per)
        self.draws = ContentionDraws(n, spec.sim.seed) if n > 2 else None
        self.sliced_factor = expected_slowdown(n, "sliced") if n > 2 else 1.0
        self.merge_s = cost.device_copy_s(m.num_experts * m.expert_bytes) if layout.merge else 0.0
        self.slowdown = cost.copy_slowdown
        self.windows: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # per rank: issued pulls' spans
        self.copy_free = [0.0] * n  # when each rank's copy engine is next free
        self.released = [[0.0, 0.0] for _ in range(n)]  # per rank and slot: when its last layer's experts ended
        self.cycle = [0] * n  # per rank: pulls issued so far (k)
        self.pulled_at: list[dict[int, float]] = [{} for _ in range(n)]  # per rank: pull k -> when it is in
        self.next_pass = [0] * n  # per rank: the pull index of its next pass's first MoE layer
        self._sliced_s: dict[int, float] = {}  # per rank: a sliced pull's time
        # per rank: computing (slowed while pulling), its copy engine pulling, its experts waiting on a pull
        self.num_entities = {"rank": n, "copy_engine": n, "pull_wait": n}
        self.busy_s = {"rank": 0.0, "copy_engine": 0.0, "pull_wait": 0.0}

    def add(self, request: Request) -> None:
        self.sched.add(request)
        self._schedule()

    def poke(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        for work in self.sched.schedule(self.loop.now):
            self._run(work.group, work.batches[0])

    def pull_time_s(self, rank: int) -> float:
        """One MoE layer's pull on ``rank``'s copy engine, contention included."""
        per, c = self.by_source[rank], self.cost
        if not per:
            return 0.0
        fixed = self._pull_s(rank)
        if fixed is not None:
            return fixed
        return sum(c.transfer_s(b) * (self.draws.draw() if self.draws else 1) for b in per.values())

    def _pull_s(self, rank: int) -> float | None:
        """A sliced pull's time on ``rank`` (the same every time); None: naive pulls draw theirs."""
        if self.layout.copy_plan != "sliced":  # slices interleave the sources: one stream, pipelined
            return None
        if rank not in self._sliced_s:
            self._sliced_s[rank] = self.cost.transfer_s(sum(self.by_source[rank].values())) * self.sliced_factor
        return self._sliced_s[rank]

    def _issue(self, rank: int, upto: int) -> None:
        """Issue ``rank``'s pulls up to index ``upto``, in order, as its copy engine does: pull j starts
        once the engine is free and its slot was released (the experts of pull j-2 have run)."""
        while self.cycle[rank] <= upto:
            j = self.cycle[rank]
            start = max(self.copy_free[rank], self.released[rank][j % 2])
            took = self.pull_time_s(rank)
            self.busy_s["copy_engine"] += took
            self.copy_free[rank] = start + took
            self.pulled_at[rank][j] = self.copy_free[rank]
            self.windows[rank].append((start, start + took))
            self.cycle[rank] += 1

    def _compute(self, rank: int, t: float, d: float) -> float:
        """When ``d`` seconds of kernels started at ``t`` end: slower while the copy engine pulls
        (``copy_slowdown``, DWDP Appendix A: power-capped clocks and shared HBM)."""
        f, windows = self.slowdown, self.windows[rank]
        while windows and windows[0][1] <= t:  # a rank's time only moves forward
            windows.pop(0)
        for a, b in windows:
            if d <= 0:
                break
            if a > t:  # full speed until the pull starts
                run = min(d, a - t)
                t, d = t + run, d - run
            run = min(d, max(0.0, b - t) / f)
            t, d = t + run * f, d - run
        return t + d

    def _run(self, rank: int, batch) -> None:
        m, c = self.model, self.cost
        shape = AttnShape.of_batch(batch, m.index_topk)
        attn, attn_dense = c.attention_s(shape, 1, False), c.attention_s(shape, 1, True)
        experts = c.experts_s(round(shape.num_tokens * m.top_k), m.num_experts) + self.merge_s  # every expert runs here
        now = self.loop.now
        walk = self._layers if self.fast and self.cores is None else self._layers_on_cores
        t, waited, core_waited = walk(rank, now, attn, attn_dense, experts, c.head_s(shape, 1))
        compute = t - now - waited - core_waited
        self.busy_s["pull_wait"] += waited
        self.busy_s["rank"] += compute
        self.started([s.request_id for s in batch.seqs], compute, now)
        if now < self.trace_until_s:
            self.span(f"rank{rank}/main", "batch", now, t)
        self.loop.at(t, self._done, rank, batch)

    def _layers_on_cores(self, rank: int, now: float, attn: float, attn_dense: float, experts: float,
                         head: float) -> tuple[float, float, float]:
        """The batch's layers and head on ``rank`` from ``now``: when they end, the seconds its
        experts waited for their pulls, and those it waited for a core (the oracle of ``_layers``,
        and the only path with shared cores)."""
        m = self.model
        pulls = bool(self.by_source[rank])
        t = now
        waited = core_waited = 0.0

        def on_core(t: float, d: float) -> float:  # later while every shared core is taken (sim/cores.py)
            nonlocal core_waited
            start = t if self.cores is None else self.cores.reserve(t, d, self.loop.now)
            core_waited += start - t
            return self._compute(rank, start, d)
        k0 = self.next_pass[rank]
        if pulls:
            self._issue(rank, k0 + 1)
        for layer in range(m.num_layers):
            if layer < m.num_dense_layers:
                t = on_core(t, attn_dense)
                continue
            k = k0 + layer - m.num_dense_layers
            if pulls:
                self._issue(rank, k + 1)  # the experts of k-1 ran: pull k+1's slot is free
            t = on_core(t, attn)
            ready = self.pulled_at[rank].pop(k) if pulls else t
            waited += max(0.0, ready - t)
            t = on_core(max(t, ready), experts)
            self.released[rank][k % 2] = t
        self.next_pass[rank] = k0 + m.num_moe_layers
        return on_core(t, head), waited, core_waited

    def _layers(self, rank: int, now: float, attn: float, attn_dense: float, experts: float,
                head: float) -> tuple[float, float, float]:
        """``_layers_on_cores`` on cores of their own, written out: the same pulls, kernels and
        sums in the same order (a batch walks every layer here)."""
        m, compute = self.model, self._compute
        pulls = bool(self.by_source[rank])
        pulled_at, released = self.pulled_at[rank], self.released[rank]
        pull_s, busy, windows = self._pull_s(rank), self.busy_s, self.windows[rank]
        t, waited = now, 0.0
        k0 = self.next_pass[rank]
        if pulls:
            self._issue(rank, k0 + 1)
        for _ in range(m.num_dense_layers):
            t = compute(rank, t, attn_dense)
        for k in range(k0, k0 + m.num_moe_layers):
            if not pulls:
                t = compute(rank, compute(rank, t, attn), experts)
                released[k % 2] = t
                continue
            if pull_s is not None and self.cycle[rank] == k + 1:  # _issue(rank, k + 1) of a sliced pull, written out
                start, slot = self.copy_free[rank], released[(k + 1) % 2]
                start = start if start >= slot else slot
                busy["copy_engine"] += pull_s
                self.copy_free[rank] = pulled_at[k + 1] = start + pull_s
                windows.append((start, start + pull_s))
                self.cycle[rank] = k + 2
            else:
                self._issue(rank, k + 1)
            t = compute(rank, t, attn)
            ready = pulled_at.pop(k)
            d = ready - t
            waited += d if d > 0.0 else 0.0
            t = compute(rank, t if t >= ready else ready, experts)
            released[k % 2] = t
        self.next_pass[rank] = k0 + m.num_moe_layers
        return compute(rank, t, head), waited, 0.0

    def _done(self, rank: int, batch) -> None:
        finished = self.sched.update(rank, batch, {s.request_id: 0 for s in batch.seqs if s.is_last_chunk})
        self.sampled(batch, finished, self.loop.now)
        self.sched.release(rank)
        self._schedule()


@dataclass(frozen=True)
class LayerRoofline:
    """DWDP §3's per-layer model for one batch: T_DWDP = max(T_compute, T_prefetch) against
    T_DEP = T_compute + T_all2all, with the cost model's operators."""

    isl: int
    compute_s: float  # attention block + experts of the batch (the same work in both)
    prefetch_s: float  # the lacking experts over the link, uncontended
    all2all_s: float  # DEP's dispatch + combine of the batch

    @property
    def hidden(self) -> float:
        """T_compute / T_prefetch: above 1 the pull hides behind compute."""
        return self.compute_s / self.prefetch_s

    @property
    def speedup(self) -> float:
        """T_DEP / T_DWDP."""
        return (self.compute_s + self.all2all_s) / max(self.compute_s, self.prefetch_s)


def layer_roofline(cost, dp: int, isl: int, batch: int = 1) -> LayerRoofline:
    """One MoE layer of ``batch`` prompts of ``isl`` tokens per rank, DWDP``dp`` vs DEP``dp``."""
    m = cost.model
    shape = AttnShape.of([(0, isl, True)] * batch, m.index_topk)
    tokens = batch * isl
    compute = cost.attention_s(shape, 1, False) + cost.experts_s(tokens * m.top_k, m.num_experts)
    lacking = m.num_experts - -(-m.num_experts // dp)
    share = (dp - 1) / dp
    a2a = cost.all_to_all_s(cost.dispatch_bytes(tokens) * share) + cost.all_to_all_s(cost.combine_bytes(tokens) * share)
    return LayerRoofline(isl, compute, cost.transfer_s(lacking * m.expert_bytes), a2a)


def crossover(points: list[LayerRoofline], metric: str = "hidden") -> float | None:
    """The ISL where ``metric`` crosses 1 going up (log-linear between the points), or None."""
    for a, b in zip(points, points[1:]):
        ya, yb = getattr(a, metric), getattr(b, metric)
        if ya < 1 <= yb:
            f = (1 - ya) / (yb - ya)
            return math.exp(math.log(a.isl) + f * (math.log(b.isl) - math.log(a.isl)))
    return None
