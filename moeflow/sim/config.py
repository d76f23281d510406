"""SimConfig: one YAML file describes an experiment — model, hardware, cost source, workload,
rates, SLO and the systems to compare. Everything is validated before anything runs, and every
random source takes its seed from here.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import yaml

from moeflow.bench.workload import WorkloadConfig
from moeflow.config import SchedulerConfig
from moeflow.sim.system import SystemConfig

COSTS = ("analytic", "profiled")


@dataclass(frozen=True)
class SimConfig:
    model: str  # model preset (sim/model_spec.py)
    hardware: str  # hardware preset (sim/hardware.py)
    systems: dict[str, SystemConfig]
    workload: WorkloadConfig  # rate_rps is set per probe
    cost: str = "analytic"
    profile: str | None = None  # profiled cost: the JSON ``moeflow profile`` wrote
    hardware_overrides: tuple[tuple[str, float], ...] = ()
    machine: str | None = None  # hardware cpu-here: the `moeflow env --json` report of that machine
    dtype: str | None = None  # hardware cpu-here: the dtype run there (default: what auto picks there)
    rps: tuple[float, ...] = (1.0,)
    slo_ttft_s: float | None = None
    find_slo_rps: bool = False
    slo_probes: int = 6
    slo_rel_tol: float = 0.02

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"sim config: {msg}")

        need(self.cost in COSTS, f"cost must be one of {COSTS}, got {self.cost!r}")
        need(self.cost != "profiled" or bool(self.profile), "cost: profiled needs profile: FILE.json")
        need(bool(self.systems), "systems: give at least one")
        need(all(r > 0 for r in self.rps), f"rps must all be > 0, got {list(self.rps)}")
        need(not self.find_slo_rps or (self.slo_ttft_s or 0) > 0, "find_slo_rps needs slo_ttft_s > 0")


def _pick(cls, d: dict, where: str) -> dict:
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"sim config: unknown keys in {where}: {sorted(unknown)} (known: {sorted(known)})")
    return d


def _system(name: str, d: dict) -> SystemConfig:
    if not isinstance(d, dict):
        raise ValueError(f"sim config: systems.{name} must be a mapping, got {d!r}")
    d = dict(_pick(SystemConfig, {**d, "name": name}, f"systems.{name}"))
    d["scheduler"] = SchedulerConfig(**_pick(SchedulerConfig, d.get("scheduler") or {}, f"systems.{name}.scheduler"))
    return SystemConfig(**d)


def _number(v, where: str) -> float:
    # NOTE: YAML 1.1 reads 28e9 (no dot, no sign) as a string; accept what float() accepts
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"sim config: {where} must be a number, got {v!r}") from None


def parse_config(d: dict) -> SimConfig:
    if not isinstance(d, dict):
        raise ValueError("sim config: the file must hold a mapping")
    d = dict(_pick(SimConfig, d, "the top level"))
    for key in ("model", "hardware", "systems", "workload"):
        if key not in d:
            raise ValueError(f"sim config: missing {key!r}")
    d["systems"] = {n: _system(n, s) for n, s in (d["systems"] or {}).items()}
    w = dict(_pick(WorkloadConfig, d["workload"] or {}, "workload"))
    w.setdefault("rate_rps", 1.0)
    d["workload"] = WorkloadConfig(**w)
    d["hardware_overrides"] = tuple(sorted((k, _number(v, f"hardware_overrides.{k}"))
                                           for k, v in (d.get("hardware_overrides") or {}).items()))
    d["rps"] = tuple(float(r) for r in (d.get("rps") or (1.0,)))
    return SimConfig(**d)


def load_config(path: str) -> SimConfig:
    with open(path) as f:
        return parse_config(yaml.safe_load(f))
