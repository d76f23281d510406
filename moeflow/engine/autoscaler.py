"""``moeflow serve --autoscale POLICY.yaml``: the engine's thread feeds the controller
(``scheduler/autoscale.py``) a window of the live load every ``sample_s`` and applies its decisions
through the scale interface, one change at a time (an attention change first, then the expert
holders'); every decision is logged with its inputs and counted in ``/metrics``. Runs between steps."""
from __future__ import annotations

import dataclasses
import logging

import yaml

from moeflow.config import ConfigError
from moeflow.scheduler.autoscale import AutoscalePolicy, Controller, Sample

log = logging.getLogger("moeflow.autoscale")


def load_policy(path: str) -> tuple[AutoscalePolicy, float]:
    """(the policy, the sampling period) of a POLICY.yaml, refused with the key that is wrong."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--autoscale {path}: a mapping of the policy's fields, got {type(raw).__name__}")
    sample_s = raw.pop("sample_s", 2.0)
    known = {f.name for f in dataclasses.fields(AutoscalePolicy)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"--autoscale {path}: unknown keys {unknown}; known: {sorted(known | {'sample_s'})}")
    try:
        return AutoscalePolicy(**raw), float(sample_s)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--autoscale {path}: {e}") from None


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy, sample_s: float, counter=None):
        """``counter``: the /metrics counter of decisions, by reason (``refused`` for a change the
        deployment would not take)."""
        self.controller, self.sample_s, self.counter = Controller(policy), sample_s, counter
        self._t0: float | None = None
        self._busy = self._wait = 0.0
        self._tpots: list[float] = []  # of the requests that finished in the window
        self._live: dict[str, tuple[float, int, float]] = {}
        self._todo: list[dict] = []  # the rest of a decision: one change at a time

    def turn(self, engine, result, now: float) -> None:
        """Account one step's result; every ``sample_s``, a window to the controller."""
        if self._t0 is None:
            self._t0 = now
        self._busy += sum(result.busy_s.values())
        self._wait += sum(result.wait_s.values())
        for rid, out in result.outputs.items():
            if out.token_id is not None:  # (first token's time, tokens, last token's time) of a live request
                first, n, _ = self._live.get(rid, (now, 0, now))
                self._live[rid] = (first, n + 1, now)
        for r in result.finished:
            first, n, last = self._live.pop(r.request_id, (now, 0, now))
            if n > 1:
                self._tpots.append((last - first) / (n - 1))
        status = engine.scale_status()
        if self._todo and not status["in_progress"]:
            self._apply(engine, self._todo.pop(0))
        if now - self._t0 < self.sample_s:
            return
        window, m, n = now - self._t0, engine.attention_count, status[engine.layout.expert_kind]
        load = engine.load()
        tpots = sorted(self._tpots)
        sample = Sample(now, m, n, attn_busy=self._busy / (window * m), attn_wait=self._wait / (window * m),
                        tpot_p90_s=tpots[int(0.9 * (len(tpots) - 1))] if tpots else None, queue=load.num_waiting,
                        kv_free=load.num_free_kv_blocks / max(1, load.num_kv_blocks))
        self._t0, self._busy, self._wait, self._tpots = now, 0.0, 0.0, []
        if status["in_progress"] or self._todo:
            return  # a window with a change under way says nothing about either membership
        d = self.controller.observe(sample)
        if d is None:
            return
        log.info("autoscale: %s -> attention %d, %s %d (predicted TPOT %.3f s) from %s", d.reason, d.attention,
                 engine.layout.expert_kind, d.ffn, d.predicted_tpot_s, d.inputs)
        if self.counter is not None:
            self.counter.labels(d.reason).inc()
        self._todo = ([{"attention": d.attention}] if d.attention != m else []) + (
            [{"ep_size": d.ffn}] if d.ffn != n else [])
        self._apply(engine, self._todo.pop(0))

    def _apply(self, engine, change: dict) -> None:
        try:
            engine.scale(**change)
        except ConfigError as e:
            log.warning("autoscale: %s refused: %s", change, e)
            self._todo = []
            if self.counter is not None:
                self.counter.labels("refused").inc()
