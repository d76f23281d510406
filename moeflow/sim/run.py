"""Simulate an experiment: each system at each rate, the SLO search, results in ``bench serve``'s
JSON schema (so ``moeflow bench plot`` overlays simulated and measured curves)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from moeflow.experiment.decode import DecodeExperiment
from moeflow.experiment.serve import Experiment
from moeflow.experiment.system import SystemSpec, system_to_dict
from moeflow.measure import compare_report as report
from moeflow.measure.metrics import summarize
from moeflow.measure.slo import (ALL_METRICS, SloMetric, SloResult, SloSearch, StopRule, find_slo_rps,
                                 slo_over_repeats, slo_rps_from_points)
from moeflow.measure.workload import generate_requests
from moeflow.sim.afd import AfdSystem
from moeflow.sim.asap import AsapSystem
from moeflow.sim.cost import AnalyticCost, CostModel
from moeflow.sim.dep import DepSystem
from moeflow.sim.dwdp import DwdpSystem
from moeflow.sim.elastic_afd import ElasticAfdSystem
from moeflow.sim.elastic_dep import ElasticDepSystem
from moeflow.sim.elastic_pd import ElasticPdSystem
from moeflow.sim.hardware import hardware_preset
from moeflow.sim.model_spec import model_preset
from moeflow.sim.pd import PdSystem
from moeflow.sim.system import RunResult, System

SYSTEMS: dict[str, type[System]] = {"dep": DepSystem, "asap": AsapSystem, "dwdp": DwdpSystem, "afd": AfdSystem,
                                    "pd": PdSystem}  # mode -> system


def make_system(spec: SystemSpec, cost: CostModel, trace_until_s: float = 0.0) -> System:
    if spec.layout.mode not in SYSTEMS:
        raise ValueError(f"system {spec.name!r}: mode {spec.layout.mode!r} is not simulated; "
                         f"simulated modes: {sorted(SYSTEMS)}")
    if spec.layout.mode == "pd":  # its instances are systems of their own modes
        return (ElasticPdSystem if spec.autoscale else PdSystem)(spec, cost, trace_until_s, make_system)
    if spec.autoscale and spec.layout.mode == "dwdp":
        raise ValueError(f"system {spec.name!r}: the simulator resizes afd's, pd's and dep's members, not dwdp's ranks "
                         f"(the engine does: moeflow serve --mode dwdp --autoscale)")
    if spec.autoscale:  # afd or dep under the controller (experiment/system.check_autoscale)
        return (ElasticDepSystem if spec.layout.mode == "dep" else ElasticAfdSystem)(spec, cost, trace_until_s)
    return SYSTEMS[spec.layout.mode](spec, cost, trace_until_s)


def build_cost(cfg: Experiment | DecodeExperiment) -> CostModel:
    """The cost model of an experiment's target, for its model and dtype."""
    model, target = model_preset(cfg.model), cfg.target
    if target.cost == "profiled":
        from moeflow.sim.profiled import ProfiledCost

        return ProfiledCost.load(model, target.profile)
    report = None
    if target.machine:
        with open(target.machine) as f:
            report = json.load(f)
    if target.hardware is None:
        raise ValueError("experiment: the analytic cost needs hardware: PRESET")
    hw = hardware_preset(target.hardware, report, None if cfg.dtype == "auto" else cfg.dtype)
    return AnalyticCost(model, hw.with_overrides(**dict(target.hardware_overrides)))


@dataclass
class SystemRun:
    result: dict  # bench serve schema
    num_events: int
    spans: list


def run_point(system: SystemSpec, cost: CostModel, cfg: Experiment, rate: float, seed: int | None = None,
              stop: StopRule | None = None, trace_until_s: float = 0.0,
              num_requests: int | None = None) -> tuple[dict, RunResult]:
    workload = cfg.point_workload(rate, cfg.workload.seed if seed is None else seed, num_requests)
    sim = make_system(system, cost, trace_until_s)
    res = sim.run(generate_requests(workload), stop)
    p = summarize(rate, res.records, 0.0, cfg.workload.length_scale, num_failed=res.num_failed,
                  num_aborted=res.num_pending, slo=cfg.goodput_slo)
    # what the deployment cost: every process from its start to its exit (an elastic one's members
    # come and go), over the run; goodput per process-second where the experiment sets both SLOs
    p["process_s"] = res.process_s if res.process_s is not None else system.layout.num_processes * res.end_s
    if "goodput_rps" in p and p["process_s"] > 0:
        p["goodput_per_process_s"] = p["goodput_rps"] * p["duration_s"] / p["process_s"]
    if res.changes:
        p["membership_changes"] = res.changes
    if res.windows:
        p["autoscale_windows"] = res.windows
    # the engine's benchmark reports these too (bench/probe.py): per process there, per device here
    p["output_tok_s"] = sum(r.num_output for r in res.records) / p["duration_s"] if p["duration_s"] > 0 else 0.0
    p["output_tok_s_per_process"] = p["output_tok_s"] / system.layout.num_processes
    p["sim_events"] = res.num_events
    p["sim_busy"] = res.busy  # per role: fraction of the run its devices computed (not waited)
    p["preemptions"] = res.preemptions
    if res.split:  # dep: a rank's steps as attention / experts / all-to-all / barrier wait
        p["sim_split"] = res.split
    if res.expert_imbalance is not None:  # skewed expert loads: the most loaded device / the mean
        p["sim_expert_imbalance"] = res.expert_imbalance
    if res.stopped_early:
        p.update(stopped_early=True, stopped_by=stop.metric.name, ttft_mean_s=res.mean_ttft_bound_s,
                 ttft_p50_s=None, ttft_p90_s=None, ttft_p99_s=None)
    return p, res


def _decides(point: dict, metric: SloMetric) -> bool:
    """A probe stopped early decides only the metric that stopped it (it failed that one)."""
    return not point.get("stopped_early") or point.get("stopped_by", "mean") == metric.name


def run_system(name: str, cfg: Experiment, cost: CostModel, rates: tuple[float, ...], find_slo: bool,
               trace_rate: float | None = None, trace_window_s: float = 0.0, repeats: int = 1,
               slo_metrics: tuple[SloMetric, ...] | None = None) -> SystemRun:
    """The sweep (and SLO search) once per seed (seed, seed+1, ... as ``bench compare`` runs
    them); points are averaged over the seeds, each seed's kept under ``repeats``. The search runs
    once per metric of ``slo_metrics`` (default: the config's ``slo_metric``), reusing every
    completed probe; the first metric is the result's ``slo_rps``."""
    system = cfg.systems[name]
    searched = slo_metrics or (SloMetric.parse(cfg.slo_metric),)
    metric = searched[0]
    events = 0
    spans: list = []
    reps = []
    for k in range(repeats):
        seed = cfg.workload.seed + k
        points: dict[float, dict] = {}  # completed runs: they decide every metric
        stopped: dict[str, dict[float, dict]] = {m.name: {} for m in searched}  # probes stopped early, per metric

        def measure(rate: float, m: SloMetric | None = None) -> float:
            nonlocal events, spans
            if rate in points:
                return m.score(points[rate]) if m else math.nan
            tracing = k == 0 and trace_rate is not None and math.isclose(rate, trace_rate)
            p, res = run_point(system, cost, cfg, rate, seed, StopRule(m, cfg.slo_ttft_s) if m else None,
                               trace_window_s if tracing else 0.0)
            events += res.num_events
            if tracing:
                spans = res.spans
            (stopped[m.name] if p.get("stopped_early") else points)[rate] = p
            return m.score(p) if m else math.nan

        for r in rates:
            measure(r)
        found: dict[str, SloResult] = {}
        if find_slo:
            for m in searched:
                search = SloSearch(cfg.slo_ttft_s, cfg.slo_probes, cfg.slo_rel_tol, metric=m)
                measured = {r: m.score(p) for r, p in {**points, **stopped[m.name]}.items() if _decides(p, m)}
                found[m.name] = find_slo_rps(lambda r, m=m: measure(r, m), search, measured)
        own = {**{r: p for ps in reversed(list(stopped.values())) for r, p in ps.items()}, **points}
        all_points = [own[r] for r in sorted(own)]
        slo = {}
        if cfg.slo_ttft_s:
            for m in ALL_METRICS + tuple(m for m in searched if m not in ALL_METRICS):
                res = found.get(m.name) or slo_rps_from_points(
                    [p for p in [*points.values(), *stopped.get(m.name, {}).values()]], m, cfg.slo_ttft_s)
                slo[m.name] = dataclasses.asdict(res)
        reps.append({"seed": seed, "sweep": [points[r] for r in rates], "probes": [p for p in all_points
                                                                                  if p["rps"] not in rates],
                     "slo": slo, "search": dataclasses.asdict(found[metric.name]) if found else None,
                     "all_points": all_points})
    names = list(dict.fromkeys([m.name for m in ALL_METRICS] + [m.name for m in searched]))
    by_metric = {n: slo_over_repeats([r["slo"].get(n) for r in reps]) for n in names}
    points = reps[0]["all_points"] if repeats == 1 else report.aggregate_points(reps)
    result = {"mode": system.layout.mode, "simulated": True,
              "config": {"name": system.name, **system_to_dict(system), "model": cfg.model,
                         "hardware": cfg.target.hardware, "cost": cfg.target.cost, "devices": system.layout.num_processes},
              "workload": {k: v for k, v in cfg.workload.to_dict().items() if k != "rate_rps"},
              "slo_ttft_s": cfg.slo_ttft_s, "slo_metric": metric.name,
              "slo_metrics_searched": [m.name for m in searched] if find_slo else [],
              "slo_rps": by_metric[metric.name]["median"] if find_slo else None,
              "slo_rps_at_least": by_metric[metric.name]["median_at_least"] if find_slo else None,
              "slo_upper_rps": reps[0]["search"]["upper_rps"] if find_slo and repeats == 1 else None,
              "slo_rps_by_metric": by_metric, "points": points}
    if repeats > 1:
        result["repeats"] = [{k: v for k, v in r.items() if k != "all_points"} for r in reps]
    return SystemRun(result, events, spans)
