"""The asap simulation's speed: CPU seconds of one ``run_point`` of configs/asap-cm384.yaml at 20 rps
(5 simulated minutes), and simulated requests per CPU second.

``python docs/results/sim/speed_asap.py LABEL [OVERRIDE ...]`` (overrides as ``simulate --set`` takes
them, e.g. ``sim.compute_jitter_cv=0``). Run it from the checkout whose code is measured, and
interleave the checkouts compared: the machine's speed drifts by tens of percent within minutes.
"""
from __future__ import annotations

import sys
import time

from moeflow.experiment.serve import load_experiment
from moeflow.sim.run import build_cost, run_point

if __name__ == "__main__":
    overrides = tuple(sys.argv[2:])
    cfg = load_experiment("configs/asap-cm384.yaml", overrides)
    cost = build_cost(cfg)
    t = time.process_time()
    point, res = run_point(cfg.systems["asap"], cost, cfg, 20.0)
    took = time.process_time() - t
    print(f"{sys.argv[1]} {overrides}: {point['completed']} requests, {res.num_events} events, {took:.2f} s CPU, "
          f"{point['completed'] / took:.0f} req/s", flush=True)
