"""Simulate an experiment: each system at each rate, the SLO search, results in ``bench serve``'s
JSON schema (so ``moeflow bench plot`` overlays simulated and measured curves)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from moeflow.bench.metrics import summarize
from moeflow.bench.slo import SloSearch, find_slo_rps, probe_ttft_s
from moeflow.bench.workload import generate_requests
from moeflow.experiment import Experiment, SystemSpec, system_to_dict
from moeflow.sim.asap import AsapSystem
from moeflow.sim.cost import AnalyticCost, CostModel
from moeflow.sim.dep import DepSystem
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset
from moeflow.sim.system import RunResult, System

SYSTEMS: dict[str, type[System]] = {"dep": DepSystem, "asap": AsapSystem}  # mode -> simulated system


def make_system(spec: SystemSpec, cost: CostModel, trace_until_s: float = 0.0) -> System:
    if spec.layout.mode not in SYSTEMS:
        raise ValueError(f"system {spec.name!r}: mode {spec.layout.mode!r} is not simulated; "
                         f"simulated modes: {sorted(SYSTEMS)}")
    return SYSTEMS[spec.layout.mode](spec, cost, trace_until_s)


def build_cost(cfg: Experiment) -> CostModel:
    model = model_preset(cfg.model)
    if cfg.cost == "profiled":
        from moeflow.sim.profiled import ProfiledCost

        return ProfiledCost.load(model, cfg.profile)
    report = None
    if cfg.machine:
        with open(cfg.machine) as f:
            report = json.load(f)
    if cfg.hardware is None:
        raise ValueError("experiment: the analytic cost needs hardware: PRESET")
    hw = hardware_preset(cfg.hardware, report, None if cfg.dtype == "auto" else cfg.dtype)
    return AnalyticCost(model, hw.with_overrides(**dict(cfg.hardware_overrides)))


@dataclass
class SystemRun:
    result: dict  # bench serve schema
    num_events: int
    spans: list


def run_point(system: SystemSpec, cost: CostModel, cfg: Experiment, rate: float,
              stop_above_mean_ttft_s: float | None = None, trace_until_s: float = 0.0) -> tuple[dict, RunResult]:
    workload = dataclasses.replace(cfg.workload, rate_rps=rate)
    sim = make_system(system, cost, trace_until_s)
    res = sim.run(generate_requests(workload), stop_above_mean_ttft_s)
    p = summarize(rate, res.records, 0.0, cfg.workload.length_scale)
    p["sim_events"] = res.num_events
    p["sim_busy"] = res.busy  # per role: fraction of the run its devices computed (not waited)
    if res.stopped_early:
        p.update(stopped_early=True, ttft_mean_s=res.mean_ttft_bound_s, ttft_p50_s=None, ttft_p90_s=None,
                 ttft_p99_s=None)
    return p, res


def run_system(name: str, cfg: Experiment, cost: CostModel, rates: tuple[float, ...], find_slo: bool,
               trace_rate: float | None = None, trace_window_s: float = 0.0) -> SystemRun:
    system = cfg.systems[name]
    points: dict[float, dict] = {}
    events = 0
    spans: list = []

    def measure(rate: float, stop: float | None = None) -> float:
        nonlocal events, spans
        tracing = trace_rate is not None and math.isclose(rate, trace_rate)
        p, res = run_point(system, cost, cfg, rate, stop, trace_window_s if tracing else 0.0)
        events += res.num_events
        if tracing:
            spans = res.spans
        points[rate] = p
        return probe_ttft_s(p)

    for r in rates:
        measure(r)
    slo = None
    if find_slo:
        search = SloSearch(cfg.slo_ttft_s, cfg.slo_probes, cfg.slo_rel_tol)
        measured = {r: probe_ttft_s(p) for r, p in points.items()}
        slo = find_slo_rps(lambda r: measure(r, search.slo_ttft_s), search, measured)
    result = {"mode": system.layout.mode, "simulated": True,
              "config": {"name": system.name, **system_to_dict(system), "model": cfg.model, "hardware": cfg.hardware,
                         "cost": cfg.cost, "devices": system.layout.num_processes},
              "workload": {k: v for k, v in cfg.workload.to_dict().items() if k != "rate_rps"},
              "slo_ttft_s": cfg.slo_ttft_s, "slo_rps": slo.rps if slo else None,
              "slo_upper_rps": slo.upper_rps if slo else None,
              "points": [points[r] for r in sorted(points)]}
    return SystemRun(result, events, spans)
