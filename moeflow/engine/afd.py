"""Mode ``afd``: M attention instances and N stateless FFN daemons (attention-FFN disaggregation).

The engine owns the scheduler and the control pipes to the attention instances; the FFN daemons
only see activations (``workers/afd_connector.py``). Each step sends every instance its m
micro-batches and waits for all M: the daemons aggregate the same (layer, micro-batch) from every
instance they serve, so the instances advance in step. With overlap scheduling (default) step
t+1 is scheduled and sent before step t's results are back, so an instance starts it without a
round trip through the engine; at most two steps are in flight.

A worker that dies fails every request (each instance depends on its daemons and each daemon on
all the instances it serves, within the step) and the deployment stops; nothing is left behind.
"""
from __future__ import annotations

import time
from collections import deque

from moeflow.config import EngineConfig
from moeflow.core import Work
from moeflow.engine.base import StepResult, clock
from moeflow.engine.elastic import ElasticExperts
from moeflow.engine.elastic_attention import AttentionGroups
from moeflow.engine.process_engine import ProcessEngine
from moeflow.engine.startup import Blueprint
from moeflow.layout import AfdLayout
from moeflow.membership_messages import InstancesServed, ServeInstances
from moeflow.messages import WorkDone
from moeflow.workers.launch import WorkerDied

_IDLE_S = 2e-3  # an idle deployment's step sleeps this long (never a busy spin)


class AfdEngine(ElasticExperts, ProcessEngine):
    mode_name = "afd"

    def __init__(self, model_path: str, config: EngineConfig, layout: AfdLayout):
        super().__init__(config, layout)
        self.attention = self._build(model_path, Blueprint(
            ("afd_attention", layout.attn_workers), ("ffn", layout.ffn_workers),
            computes=layout.topology == "all"))
        self._steps: deque[list[Work]] = deque()  # steps sent, oldest first
        self._done: dict[int, WorkDone] = {}  # the oldest step's answers so far, by instance
        # --max-ffn-workers, --max-attn-workers: FFN daemons, attention instances join and leave while serving
        self._elastic(AttentionGroups(self, layout.attention_capacity, self.scheduler)
                      if layout.max_attn_workers else None)
        self._serving: set | None = None  # daemons yet to answer a ServeInstances, while one is out

    def _instances_served(self, count: int) -> bool:
        """At a step boundary, every daemon told to aggregate instances 0..count-1 and answered."""
        if self._steps:
            return False
        daemons = self.eplb.expert_workers
        if self._serving is None:
            self._serving = {w.index for w in daemons}
            for w in daemons:
                self.deployment.send(w, ServeInstances(count))
        for w, msg in self.eplb.take(self.deployment.recv_any(daemons, 0.05)):  # a mover's report is eplb's
            if isinstance(msg, InstancesServed) and msg.count == count:
                self._serving.discard(msg.index)
            else:
                raise WorkerDied(f"{w.name} sent {type(msg).__name__} while changing the instances it serves", w)
        if self._serving:
            return False
        self._serving = None
        return True

    def _idle_group(self, group: int) -> bool:
        return not self._steps

    def _regions_left(self, regions: list[int]) -> None:
        """Nothing to do: each daemon forgot them when told the instances it serves."""

    def step(self) -> StepResult:
        self._check_alive()
        ag = self.attention_groups
        if ag is not None:
            ag.turn()
        try:
            if ag is not None and ag.at_boundary:  # a change waits for a step with nothing in flight
                if self._steps:
                    return self._collect()
                time.sleep(_IDLE_S)
                return StepResult({}, [])
            if not self._steps and not self._issue():
                if self.eplb.membership is not None and self.eplb.membership.busy:
                    self.eplb.idle()  # a change of membership goes on with no work in flight
                time.sleep(_IDLE_S)
                return StepResult({}, [])
            if self.layout.overlap_scheduling and len(self._steps) < 2:
                self._issue()  # step t+1 goes out while step t runs
            return self._collect()
        except WorkerDied as e:
            return self._fail(str(e))

    def _issue(self) -> bool:
        works = self.scheduler.schedule(clock())
        if not works:
            return False
        for w in works:
            self._run_work(w.group, w.batches, [self.attention[w.group]])
        self._steps.append(works)
        return True

    def _collect(self) -> StepResult:
        """Every instance's results of the oldest step in flight, applied once the last is in;
        waits at most ``max_wait_s`` for them (nothing returned before), so a loop driving this
        engine beside others (pd's instances and handoffs) turns meanwhile."""
        works, done = self._steps[0], self._done
        deadline = clock() + self.max_wait_s
        while len(done) < len(works):
            left = deadline - clock()
            if left <= 0:
                return StepResult({}, [])
            waiting = [self.attention[w.group] for w in works if w.group not in done]
            for _, msg in self._recv_any(waiting, left):
                if isinstance(msg, WorkDone):
                    done[msg.group] = msg
        self._steps.popleft()
        self._done = {}
        result = StepResult({}, [])
        for w in works:  # a request that stopped in the previous step has its result here dropped
            self._complete(done[w.group], w, result, f"attention{w.group}")
        result.finished += self._failed_batches()
        return result

    def drain(self, timeout_s: float = 120.0) -> None:
        deadline = clock() + timeout_s
        try:
            while self._steps and self.failed is None:
                if clock() > deadline:
                    raise RuntimeError(f"{len(self._steps)} steps still in flight after {timeout_s:g} s")
                self._collect()
        except WorkerDied as e:
            self._fail(str(e))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._steps)

    def _on_fail(self) -> None:
        self._steps.clear()
        self._done = {}

    def _busy(self) -> bool:
        return bool(self._steps)
