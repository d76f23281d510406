"""``moeflow serve --autoscale POLICY.yaml``: the engine's thread feeds the controller
(``scheduler/autoscale.py``) a window of the live load every ``sample_s`` and applies its decisions
through the scale interface, one change at a time (an attention change first, then the expert
holders'); every decision is logged with its inputs and counted in ``/metrics``. Runs between steps."""
from __future__ import annotations

import logging

import yaml

from moeflow.config import ConfigError
from moeflow.autoscale_config import AutoscalePolicy, policy_from
from moeflow.scheduler.autoscale import Controller
from moeflow.scheduler.load_window import LoadWindow

log = logging.getLogger("moeflow.autoscale")


def load_policy(path: str, cls: type = AutoscalePolicy) -> tuple:
    """(the policy, the sampling period) of a POLICY.yaml, refused with the key that is wrong (``cls``:
    ``PdAutoscalePolicy`` for a pd deployment)."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--autoscale {path}: a mapping of the policy's fields, got {type(raw).__name__}")
    return policy_from(raw, f"--autoscale {path}", cls)


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy, sample_s: float, counter=None):
        """``counter``: the /metrics counter of decisions, by reason (``refused`` for a change the
        deployment would not take)."""
        self.controller, self.sample_s, self.counter = Controller(policy), sample_s, counter
        self.window: LoadWindow | None = None
        self._todo: list[dict] = []  # the rest of a decision: one change at a time

    def turn(self, engine, result, now: float) -> None:
        """Account one step's result; every ``sample_s``, a window to the controller."""
        w = self.window = self.window or LoadWindow(now)
        w.step(sum(result.busy_s.values()), sum(result.wait_s.values()))
        for rid, out in result.outputs.items():
            if out.token_id is not None:
                w.token(rid, now)
        for r in result.finished:
            w.finished(r.request_id, r.arrival_s)
        status = engine.scale_status()
        if self._todo and not status["in_progress"]:
            self._apply(engine, self._todo.pop(0))
        if not w.due(now, self.sample_s):
            return
        m, n, load = engine.attention_count, status[engine.layout.expert_kind], engine.load()
        sample = w.sample(now, m, n, load.num_waiting, load.num_free_kv_blocks, load.num_kv_blocks,
                          engine._oldest_unanswered_s())
        if status["in_progress"] or self._todo:
            return  # a window with a change under way says nothing about either membership
        log.debug("autoscale: window %s", sample)  # what a decision (or none) was made on
        d = self.controller.observe(sample)
        if d is None:
            return
        log.info("autoscale: %s -> attention %d, %s %d (predicted TPOT %.3f s) at %.3f from %s", d.reason, d.attention,
                 engine.layout.expert_kind, d.ffn, d.predicted_tpot_s, d.t_s, d.inputs)
        if self.counter is not None:
            self.counter.labels(d.reason).inc()
        self._todo = ([{"attention": d.attention}] if d.attention != m else []) + (
            [{"ep_size": d.ffn}] if d.ffn != n else [])
        self._apply(engine, self._todo.pop(0))

    def _apply(self, engine, change: dict) -> None:
        if not apply_change(engine, change, self.counter):
            self._todo = []


def apply_change(engine, change: dict, counter) -> bool:
    """``engine.scale(**change)``; False where the deployment would not take it (logged with its reason,
    counted as ``refused``): the rest of that decision is dropped."""
    try:
        engine.scale(**change)
        return True
    except ConfigError as e:
        log.warning("autoscale: %s refused: %s", change, e)
        if counter is not None:
            counter.labels("refused").inc()
        return False
