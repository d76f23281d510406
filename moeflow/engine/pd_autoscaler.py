"""``moeflow serve --mode pd --autoscale POLICY.yaml``: the engine's thread feeds the xPyD controller
(``scheduler/autoscale_pd.py``) a window of the live load every ``sample_s`` and applies its decisions
through ``PdEngine.scale``, one side at a time (prefill first); every decision is logged with its
inputs and counted in ``/metrics``, as ``autoscaler.py`` does for afd and asap. Runs between steps."""
from __future__ import annotations

import logging

from moeflow.autoscale_config import PdAutoscalePolicy
from moeflow.engine.autoscaler import apply_change
from moeflow.scheduler.autoscale_pd import PdController
from moeflow.scheduler.load_window import PdWindow

log = logging.getLogger("moeflow.autoscale")


class PdAutoscaler:
    def __init__(self, policy: PdAutoscalePolicy, sample_s: float, counter=None):
        self.policy, self.sample_s, self.counter = policy, sample_s, counter
        self.controller: PdController | None = None  # built at the first turn: it needs the instances' processes
        self.window: PdWindow | None = None
        self._todo: list[dict] = []

    def turn(self, engine, result, now: float) -> None:
        """Account one step's result; every ``sample_s``, a window to the controller."""
        lay = engine.layout
        if self.controller is None:
            self.controller = PdController(self.policy, lay.prefill.num_processes, lay.decode.num_processes)
        w = self.window = self.window or PdWindow(now)
        w.step(sum(v for k, v in result.busy_s.items() if k.startswith("prefill")), 0.0)
        for rid, out in result.outputs.items():
            if out.token_id is not None:
                w.token(rid, now)
        for r in result.finished:
            w.finished(r.request_id, r.arrival_s)
        w.decoding(sum(side == "decode" for side, _ in engine.where.values()), now)
        status = engine.scale_status()
        if self._todo and not status["in_progress"]:
            self._apply(engine, self._todo.pop(0))
        if not w.due(now, self.sample_s):
            return
        decode = [e.load() for e in engine.decode[:status["decode"]] if e.failed is None]
        prompts = [rid for rid, (side, _) in engine.where.items() if side == "prefill"]
        oldest = min((engine.requests[rid].arrival_s for rid in prompts if rid in engine.requests), default=None)
        sample = w.sample_pd(now, status["prefill"], status["decode"], lay.prefill.num_processes, len(prompts),
                             sum(h.state == "pending" for h in engine.handoffs.values()),
                             sum(x.num_free_kv_blocks for x in decode), sum(x.num_kv_blocks for x in decode), oldest)
        if status["in_progress"] or self._todo:
            return  # a window with a change under way says nothing about either membership
        log.debug("autoscale: window %s", sample)
        d = self.controller.observe(sample)
        if d is None:
            return
        log.info("autoscale: %s -> prefill %d, decode %d (predicted TPOT %.3f s) at %.3f from %s", d.reason,
                 d.prefill, d.decode, d.predicted_tpot_s, d.t_s, d.inputs)
        if self.counter is not None:
            self.counter.labels(d.reason).inc()
        self._todo = [{side: n} for side, n in (("prefill", d.prefill), ("decode", d.decode)) if n != status[side]]
        self._apply(engine, self._todo.pop(0))

    def _apply(self, engine, change: dict) -> None:
        if not apply_change(engine, change, self.counter):
            self._todo = []
