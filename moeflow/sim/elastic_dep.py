"""dep whose ranks (its EP size) follow the autoscaling controller while it serves
(``scheduler/autoscale_ep.py``), fed by the same window code as the engine's
(``scheduler/load_window.EpWindow``) every ``sample_s`` of simulated time; a window with a change under
way decides nothing, as the engine skips it.

The expert load the controller reads is the run's popularity (``sim/expert_load.py``: what the engine's
window converges to), its imbalance at R - 1 to R + ``max_step`` that of the placement
``scheduler/eplb.resize`` makes of the current one, as the engine's controller computes it; the memory floor, the fewest ranks
whose slots hold every expert, from the starting placement.

A decision is carried out as the engine carries it out (``engine/dep.py``, docs/elastic.md "Ranks (dep)"):

- **up**: the joiners start at the decision and serve from the first step boundary after they are
  ready: ``member_start_s`` (SimOptions) plus their slots' experts copied from the live ranks over the
  link; from then on every step has one more rank (a group of the scheduler, one more expert device,
  the placement ``resize`` made);
- **down**: the last ranks admit nothing new from the decision on and their residents finish there, in
  the barrier; once they hold nothing, the placement drops them at the next boundary.

Each rank costs its processes from its start to its exit (``process_s``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from moeflow.experiment.system import autoscale_policy
from moeflow.scheduler import groups
from moeflow.scheduler.autoscale_ep import EpController, imbalance, memory_floor
from moeflow.scheduler.eplb import resize
from moeflow.scheduler.load_window import EpWindow
from moeflow.sim.elastic_steps import ElasticSteps
from moeflow.sim.dep import DepSystem, remote_share
from moeflow.sim.expert_load import ExpertLoads, expert_map, popularity


class ElasticDepSystem(ElasticSteps, DepSystem):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        lay, m, sim = self.layout, self.model, spec.sim
        policy, self.sample_s = autoscale_policy(spec)
        cv = m.gate_load_cv if sim.expert_load_cv is None else sim.expert_load_cv
        self.pop = (np.full((m.num_moe_layers, m.num_experts), 1 / m.num_experts) if not cv
                    else popularity(m.num_experts, m.num_moe_layers, cv, sim.expert_seed))
        self.placement = expert_map(self.pop, self.ep, sim.expert_placement, getattr(lay, "num_redundant_experts", 0))
        self.controller = EpController(policy, -(-memory_floor(self.placement) // lay.tp), lay.tp)
        self.cores = self.core_pool(self.controller.most * lay.tp)  # its joiners share the machine's cores too
        self.window = EpWindow(0.0)
        self._imbalance: dict[int, float] = {}  # ranks -> imbalance, for the placement now
        self.changes: list[dict] = []
        self.windows: list[dict] = []
        self.warming = 0
        self.rank_s = 0.0  # processes x seconds (ranks x their tp), joiners and leavers included
        self._since = self._busy_seen = 0.0

    # -- the controller's inputs -------------------------------------------------------------------

    def _step(self) -> None:
        # once a global step: the engine's count (engine/ep_autoscaler.py), the pool's requests past their
        # first token
        self.window.decoding(sum(1 for r in self.sched.pool.requests.values() if r.output_token_ids), self.loop.now)
        super()._step()

    def imbalance_at(self, ranks: int) -> float:
        if ranks not in self._imbalance:
            self._imbalance[ranks] = (imbalance(self.placement, self.pop.tolist(), ranks * self.layout.tp)
                                      if ranks >= 1 else float("nan"))
        return self._imbalance[ranks]

    def _tick(self) -> None:
        now, r = self.loop.now, self.layout.dp
        self.window.step(self.busy_s["rank"] - self._busy_seen, 0.0)
        self._busy_seen = self.busy_s["rank"]
        (queue, oldest), (free, blocks) = self._queue(), self.kv_blocks()
        sample = self.window.sample_ep(now, r, self.layout.tp, queue, free, blocks, oldest,
                                       tuple(self.imbalance_at(x) for x in self.controller.sizes(r)))
        if self._change is None:  # as the engine: a window under a change decides nothing
            self.windows.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(sample).items()})
            if (d := self.controller.observe(sample)) is not None:
                self._begin(d.ranks, d.reason)
        self.loop.timer(now + self.sample_s, self._tick)  # a timer: it never keeps the run going alone

    # -- carrying a change out ---------------------------------------------------------------------

    def _account(self) -> None:
        now = self.loop.now
        self.rank_s += (self.layout.dp + self.warming) * self.layout.tp * (now - self._since)
        self._since = now

    def _begin(self, target: int, reason: str) -> None:
        now, cur, m = self.loop.now, self.layout.dp, self.model
        self.changes.append({"side": "ranks", "before": cur, "after": target, "reason": reason, "asked_s": now,
                             "done_s": None})
        ready = None
        if target > cur:
            self._account()
            self.warming = target - cur
            slots = self.placement.slots_per_device[-1]  # a joiner's devices: the last one's count each
            ready = now + self.spec.sim.member_start_s + self.link_cost("rank", "rank").transfer_s(
                slots * m.expert_bytes * m.num_moe_layers)  # its devices read in parallel
            self.loop.timer(ready, self._idle_boundary)
        else:
            for g in range(target, cur):
                groups.drain(self.sched, g)
        self._change = ("ranks", target, ready)
        self._idle_boundary()

    def _boundary(self) -> None:
        if (due := self._due()) is None:
            return
        target = due[1]
        now, pool, cur = self.loop.now, self.sched.pool, self.layout.dp
        if target < cur and not all(groups.settled(pool, g) for g in range(target, cur)):
            return
        self._account()
        self.warming = 0
        if target > cur:
            g0 = pool.groups[0].allocator
            for _ in range(target - cur):
                groups.add_group(self.sched, g0.num_blocks, g0.block_size)
        else:
            groups.remove_last(pool, cur - target)
        self._ranks(target)
        self.changes[-1]["done_s"] = now
        self._change = None

    def _ranks(self, n: int) -> None:
        """From the next step on: ``n`` ranks, each an expert device of the placement ``resize`` makes."""
        lay, sim = self.layout, self.spec.sim
        self.placement = resize(self.placement, n * lay.tp, self.pop.tolist())
        self._imbalance = {}
        self.layout = dataclasses.replace(lay, dp=n)
        self.ep = n * lay.tp
        self.local = max(self.placement.slots_per_device)  # a joiner's slots hold replicas: it reads them all
        self.loads = ExpertLoads.of_map(self.placement, self.pop, sim.expert_seed)
        self.remote_share = remote_share(self.model, self.ep, sim.dedup_dispatch)
        self.num_entities = {"rank": n}

    # -- the run -------------------------------------------------------------------------------------

    def run(self, workload, stop=None):
        self.loop.timer(self.sample_s, self._tick)
        res = super().run(workload, stop)
        res.process_s, res.changes, res.windows = self.rank_s, self.changes, self.windows
        return res

    def totals(self):
        """Per role, the mean members over the run (busy shares are of the seconds members lived)."""
        self._account()
        busy_s, _, preemptions, split_s = super().totals()
        return busy_s, {"rank": self.rank_s / self.layout.tp / max(self.loop.now, 1e-12)}, preemptions, split_s
