"""afd whose attention instances and FFN daemons follow the autoscaling controller while it serves:
the engine's own controller (``scheduler/autoscale.py``) fed by the engine's own window
(``scheduler/load_window.py``) from the simulated steps, every ``sample_s`` of simulated time, a
window with a change under way skipped as the server skips it.

A decision is carried out as the engine carries it out (docs/elastic.md), one change at a time,
attention first:

- **daemons up**: the joiners start at the decision and serve from the first step boundary after
  they are ready: ``member_start_s`` (SimOptions) plus their share of the experts copied from the
  peers over the link; **down**: from the next step boundary (a daemon is stateless, the step in
  flight brings its items back);
- **instances up**: ready after ``member_start_s`` plus the attention side's weights over the link,
  a group of the scheduler (``scheduler/groups.add_group``) from the next boundary; **down**: the
  last instances admit nothing from the decision on and leave once they hold nothing (drained).

Each member costs from its start to its exit (``process_s``: joiners from the decision, leavers
until they are gone), the cost a deployment pays for its goodput.
"""
from __future__ import annotations

import dataclasses

from moeflow.experiment.system import autoscale_policy
from moeflow.scheduler import groups
from moeflow.scheduler.autoscale import Controller
from moeflow.scheduler.load_window import LoadWindow
from moeflow.sim.afd import AfdSystem
from moeflow.sim.elastic_steps import ElasticSteps


class ElasticAfdSystem(ElasticSteps, AfdSystem):
    def __init__(self, spec, cost, trace_until_s=0.0):
        super().__init__(spec, cost, trace_until_s)
        policy, self.sample_s = autoscale_policy(spec)
        self.controller, self.window = Controller(policy), LoadWindow(0.0)
        self.cores = self.core_pool(policy.budget)  # its joiners share the machine's cores too
        self._todo: list[tuple[str, int, str]] = []  # the rest of a decision: (side, target, its reason)
        self.changes: list[dict] = []  # every change: side, before, after, reason, asked_s, done_s
        self.windows: list[dict] = []  # the windows the controller decided on (the engine logs its own)
        self.warming = {"attention": 0, "ffn": 0}  # joiners started, not yet serving
        self.member_s = {"attention": 0.0, "ffn": 0.0}  # members x seconds, joiners and leavers included
        self._since = 0.0

    # -- the controller's inputs -------------------------------------------------------------------

    def stepped(self, owns, done_s, start_s, end_s) -> None:
        self.window.step(sum(owns), sum(max(0.0, d - start_s - o) for o, d in zip(owns, done_s)))

    def _tick(self) -> None:
        now, pool = self.loop.now, self.sched.pool
        queue, oldest = self._queue()
        free = sum(g.allocator.num_free for g in pool.groups)
        sample = self.window.sample(now, self.layout.attn_workers, self.layout.ffn_workers, queue, free,
                                    sum(g.allocator.num_blocks for g in pool.groups), oldest)
        if self._change is None and not self._todo:  # as the engine: a window under a change decides nothing
            self.windows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in vars(sample).items()})
            if (d := self.controller.observe(sample)) is not None:
                self._todo = ([("attention", d.attention, d.reason)] if d.attention != self.layout.attn_workers
                              else []) + ([("ffn", d.ffn, d.reason)] if d.ffn != self.layout.ffn_workers else [])
                self._begin()
        self.loop.timer(now + self.sample_s, self._tick)  # a timer: it never keeps the run going alone

    # -- carrying a change out ---------------------------------------------------------------------

    def _account(self) -> None:
        now, lay = self.loop.now, self.layout
        for side, n in (("attention", lay.attn_workers), ("ffn", lay.ffn_workers)):
            self.member_s[side] += (n + self.warming[side]) * (now - self._since)
        self._since = now

    def _begin(self) -> None:
        if not self._todo:
            return
        side, target, reason = self._todo.pop(0)
        now, lay, m = self.loop.now, self.layout, self.model
        cur = lay.attn_workers if side == "attention" else lay.ffn_workers
        self.changes.append({"side": side, "before": cur, "after": target, "reason": reason, "asked_s": now,
                             "done_s": None})
        ready = None
        if target > cur:
            self._account()
            self.warming[side] = target - cur
            weights = (m.attention_side_bytes if side == "attention"
                       else m.expert_bytes * m.num_experts * m.num_moe_layers / target)
            ready = now + self.spec.sim.member_start_s + self.link_cost(side, side).transfer_s(weights)
            self.loop.timer(ready, self._idle_boundary)
        elif side == "attention":
            for g in range(target, cur):
                groups.drain(self.sched, g)
        else:
            ready = now
        self._change = (side, target, ready)
        self._idle_boundary()

    def _boundary(self) -> None:
        if (due := self._due()) is None:
            return
        side, target = due
        now, pool = self.loop.now, self.sched.pool
        cur = self.layout.attn_workers if side == "attention" else self.layout.ffn_workers
        if side == "attention" and target < cur and not all(groups.settled(pool, g) for g in range(target, cur)):
            return
        self._account()
        self.warming[side] = 0
        if side == "attention" and target > cur:
            g0 = pool.groups[0].allocator
            for _ in range(target - cur):
                groups.add_group(self.sched, g0.num_blocks, g0.block_size)
        elif side == "attention":
            groups.remove_last(pool, cur - target)
        field = "attn_workers" if side == "attention" else "ffn_workers"
        self.members(dataclasses.replace(self.layout, **{field: target}))
        self.changes[-1]["done_s"] = now
        self._change = None
        self._begin()

    # -- the run -------------------------------------------------------------------------------------

    def run(self, workload, stop=None):
        self.loop.timer(self.sample_s, self._tick)
        res = super().run(workload, stop)
        res.process_s, res.changes, res.windows = sum(self.member_s.values()), self.changes, self.windows
        return res

    def totals(self):
        """Per role, the mean members over the run (busy shares are of the seconds members lived)."""
        self._account()
        busy_s, _, preemptions, split_s = super().totals()
        end = max(self.loop.now, 1e-12)
        return busy_s, {k: v / end for k, v in self.member_s.items()}, preemptions, split_s
