"""``moeflow serve --mode dep|dwdp --autoscale POLICY.yaml``: the engine's thread feeds the controller of
ranks (``scheduler/autoscale_ep.py``) a window of the live load every ``sample_s`` and applies its
decisions through ``scale(ep_size=R)``; every decision is logged with its inputs and counted in
``/metrics``, as ``autoscaler.py`` does for afd and asap. Runs between steps.

The expert load is the deployment's own window (``engine/expert_load.py``, the one EPLB reads): dep's
imbalance at R - 1 to R + max_step ranks is that of the placement ``scheduler/eplb.resize`` would make
for each on it; dwdp's ranks compute their own tokens' experts, so none. The memory floor: dep, the
fewest ranks whose slots hold every expert; dwdp, its starting ranks (every other rank reads from them).
"""
from __future__ import annotations

import logging

from moeflow.autoscale_config import EpAutoscalePolicy
from moeflow.engine.autoscaler import apply_change
from moeflow.scheduler.autoscale_ep import EpController, imbalance_at, memory_floor
from moeflow.scheduler.load_window import EpWindow

log = logging.getLogger("moeflow.autoscale")


class EpAutoscaler:
    def __init__(self, policy: EpAutoscalePolicy, sample_s: float, counter=None):
        self.policy, self.sample_s, self.counter = policy, sample_s, counter
        self.controller: EpController | None = None  # built at the first turn: it needs the placement
        self.window: EpWindow | None = None

    def turn(self, engine, result, now: float) -> None:
        """Account one step's result; every ``sample_s``, a window to the controller."""
        lay, experts = engine.layout, engine.expert_load
        if self.controller is None:
            floor = memory_floor(experts.map) if experts.computes else lay.dp
            self.controller = EpController(self.policy, floor, lay.num_processes // lay.dp)
        w = self.window = self.window or EpWindow(now)
        w.step(sum(result.busy_s.values()), 0.0)
        for rid, out in result.outputs.items():
            if out.token_id is not None:
                w.token(rid, now)
        for r in result.finished:
            w.finished(r.request_id, r.arrival_s)
        w.decoding(engine._requests_decoding(), now)
        if not w.due(now, self.sample_s):
            return
        status, load, ranks = engine.scale_status(), engine.load(), lay.dp
        sizes = self.controller.sizes(ranks)
        imb = imbalance_at(experts.map, experts.window.tolist(), sizes) if experts.computes else (1.0,) * len(sizes)
        sample = w.sample_ep(now, ranks, lay.num_processes // ranks, load.num_waiting, load.num_free_kv_blocks,
                             load.num_kv_blocks, engine._oldest_unanswered_s(), imb)
        if status["in_progress"]:
            return  # a window with a change under way says nothing about either membership
        log.debug("autoscale: window %s", sample)
        d = self.controller.observe(sample)
        if d is None:
            return
        log.info("autoscale: %s -> ranks %d (predicted TPOT %.3f s) at %.3f from %s", d.reason, d.ranks,
                 d.predicted_tpot_s, d.t_s, d.inputs)
        if self.counter is not None:
            self.counter.labels(d.reason).inc()
        apply_change(engine, {"ep_size": d.ranks}, self.counter)
