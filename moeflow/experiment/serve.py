"""The serving experiment file: one YAML that drives both the real engine and the simulator.

    model: tiny                       # the engine's model (a directory or "tiny"); the simulator's preset
    dtype: auto                       # what the deployments compute in (the simulator's cpu-here rates too)
    workload: {kind: production, length_scale: 0.25, duration_s: 40, seed: 0}
    request_rate: [0.3, 0.45]         # req/s, one point each (``rps:``, its older name, is read too);
                                      # or per system, as many each: {dep2: [1, 2], asap: [0.5, 1]}
    slo_ttft_s: 8
    systems:
      dep2: {mode: dep, dp: 2}
      asap: {mode: asap, attn_dp: 1, moe_workers: 1, comm_threads: false,
             engine: {num_kv_blocks: 4096},        # EngineConfig: limits the simulator honours too
             sim: {super_kernel: true}}           # SimOptions: the simulator's modelling choices
    hardware: cpu-here                 # simulator only, with cost / profile / machine / hardware_overrides

Each ``systems:`` entry is a layout plus two sub-configs (``system.py``); the simulator-only keys
are its target (``target.py``), shared with the decode experiment (``decode.py``). Everything is
validated before anything runs, and every random source takes its seed from here. Pure Python
(the simulator reads it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from moeflow.config import ConfigError
from moeflow.experiment.system import SystemSpec, check_systems, field_names, pick_keys, system_from_dict
from moeflow.experiment.target import TARGET_KEYS, SimTarget, pop_target
from moeflow.measure.workload import WorkloadConfig


@dataclass(frozen=True)
class Experiment:
    model: str  # the engine's model (a Hugging Face directory or "tiny"); the simulator's model preset
    systems: dict[str, SystemSpec]
    workload: WorkloadConfig  # rate_rps is set per probe
    dtype: str = "auto"
    rps: tuple[float, ...] = (1.0,)
    # each system's own rates where the file gives them per system (name, rates): every system named,
    # the same count each, so that bench compare still interleaves them rate by rate
    rps_by_system: tuple[tuple[str, tuple[float, ...]], ...] = ()
    slo_ttft_s: float | None = None
    # with slo_ttft_s: each point's goodput, the requests per second within both SLOs (DistServe's)
    slo_tpot_s: float | None = None
    find_slo_rps: bool = False
    slo_probes: int = 6
    slo_rel_tol: float = 0.02
    slo_metric: str = "mean"  # what meets the SLO (measure.slo.METRICS); every result reports all of them
    # bench compare
    title: str | None = None
    repeats: int = 3  # the whole sweep, with seeds seed, seed+1, ...
    min_requests: int = 100  # requests per point at least (the window grows to hold them)
    # the saturation probe's first offered rate, doubled until throughput stops growing
    # (measure/saturation.py): throughput vs capacity; the simulator's sweeps run at it as given
    saturation_rps: float | None = None
    compare: tuple[tuple[str, str], ...] = ()  # (a, b) pairs reported as ratios; default: each vs the first
    target: SimTarget = field(default_factory=SimTarget)  # simulator only: the file's hardware/cost keys
    # workload fields swept one at a time, each value at saturation_rps (sim/sweep.py), e.g. DWDP's
    # Table 3a/3c: {isl: [1024, ...], isl_std: {values: [0, ...], with: {kind: normal}}}; per sweep:
    # (field, values, other workload fields it sets)
    sweeps: tuple[tuple[str, tuple[float, ...], tuple[tuple[str, object], ...]], ...] = ()
    roofline_isl: tuple[int, ...] = ()  # dwdp systems: DWDP §3's per-layer roofline at these prompt lengths

    @property
    def goodput_slo(self) -> tuple[float, float] | None:
        """(TTFT s, TPOT s) when the experiment sets both: each point's goodput is measured against it."""
        return (self.slo_ttft_s, self.slo_tpot_s) if self.slo_tpot_s is not None else None

    def rates(self, name: str) -> tuple[float, ...]:
        """The rates system ``name`` is measured and simulated at."""
        return dict(self.rps_by_system).get(name, self.rps)

    def point_workload(self, rate: float, seed: int, num_requests: int | None = None) -> WorkloadConfig:
        """The workload of one point at ``rate`` with ``seed``, for the engine and the simulator alike:
        the configured window, grown to hold ``min_requests`` where the rate is too low for it (not a
        drifting one's: its curves are laid on that window)."""
        w = dataclasses.replace(self.workload, rate_rps=rate, seed=seed)
        n = num_requests or w.num_requests
        drifts = bool(w.rate_curve or w.length_curve)
        if n is None and w.duration_s is not None and not drifts and rate * w.duration_s < self.min_requests:
            n = self.min_requests
        return dataclasses.replace(w, num_requests=n, duration_s=None) if n else w

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"experiment: {msg}")

        check_systems("experiment", self.dtype, self.systems, self.compare)
        need(all(r > 0 for r in self.rps), f"rps must all be > 0, got {list(self.rps)}")
        if self.rps_by_system:
            given = dict(self.rps_by_system)
            need(set(given) == set(self.systems), f"request_rate per system must name every system "
                 f"{sorted(self.systems)}, got {sorted(given)}")
            need(len({len(v) for v in given.values()}) == 1 and all(given.values()),
                 f"request_rate per system: every system needs the same number of rates (interleaved "
                 f"rate by rate), got { {n: len(v) for n, v in given.items()}}")
            need(all(r > 0 for v in given.values() for r in v), f"request_rate per system: rates must be > 0, got {given}")
        need(not self.find_slo_rps or (self.slo_ttft_s or 0) > 0, "find_slo_rps needs slo_ttft_s > 0")
        need(self.slo_tpot_s is None or (self.slo_tpot_s > 0 and (self.slo_ttft_s or 0) > 0),
             f"slo_tpot_s must be > 0 and comes with slo_ttft_s, got {self.slo_tpot_s!r}")
        from moeflow.measure.slo import SloMetric

        SloMetric.parse(self.slo_metric)
        need(isinstance(self.repeats, int) and self.repeats >= 1, f"repeats must be >= 1, got {self.repeats!r}")
        need(self.saturation_rps is None or self.saturation_rps > 0, "saturation_rps must be > 0")
        workload_fields = set(WorkloadConfig.__dataclass_fields__) - {"kind", "rate_rps", "trace_path"}
        for name, values, others in self.sweeps:
            need(name in workload_fields, f"sweeps: {name!r} is not a workload field ({sorted(workload_fields)})")
            need(bool(values), f"sweeps.{name}: give at least one value")
            need(all(k in WorkloadConfig.__dataclass_fields__ for k, _ in others),
                 f"sweeps.{name}.with: unknown workload fields {[k for k, _ in others]}")
        need(not self.sweeps or self.saturation_rps is not None, "sweeps run at saturation_rps: set it")
        need(all(isinstance(n, int) and n > 0 for n in self.roofline_isl), "roofline_isl: positive ints")


# the rates' key, as the flags spell it, and its older name (Experiment.rps)
RATE_KEYS = ("request_rate", "rps")


def parse_experiment(d: dict) -> Experiment:
    if not isinstance(d, dict):
        raise ConfigError("experiment: the file must hold a mapping")
    d = dict(pick_keys(d, field_names(Experiment) - {"target"} | set(TARGET_KEYS) | set(RATE_KEYS), "the top level"))
    if all(k in d for k in RATE_KEYS):
        raise ConfigError("experiment: give the rates once: request_rate (rps is its older name), not both")
    if "request_rate" in d:
        d["rps"] = d.pop("request_rate")
    for key in ("model", "systems", "workload"):
        if key not in d:
            raise ConfigError(f"experiment: missing {key!r}")
    model, dtype = d["model"], d.get("dtype", "auto")
    d["systems"] = {n: system_from_dict(n, s, model, dtype) for n, s in (d["systems"] or {}).items()}
    w = dict(pick_keys(d["workload"] or {}, field_names(WorkloadConfig), "workload"))
    w.setdefault("rate_rps", 1.0)
    d["workload"] = WorkloadConfig(**w)
    d["target"] = pop_target(d)
    if isinstance(d.get("rps"), dict):  # per system: the first system's rates stand for the run's
        d["rps_by_system"] = tuple((str(n), _floats(f"request_rate.{n}", v)) for n, v in d["rps"].items())
        d["rps"] = d["rps_by_system"][0][1] if d["rps_by_system"] else (1.0,)
    else:
        d["rps"] = _floats("request_rate", d["rps"]) if d.get("rps") is not None else (1.0,)  # []: saturation only
    d["compare"] = tuple(tuple(pair) for pair in (d.get("compare") or ()))
    d["sweeps"] = tuple(_sweep(k, v) for k, v in (d.get("sweeps") or {}).items())
    d["roofline_isl"] = tuple(d.get("roofline_isl") or ())
    return Experiment(**d)


def _floats(where: str, v) -> tuple[float, ...]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (float(v),)
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"experiment: {where} must be a list of rates (req/s), got {v!r}")
    try:
        return tuple(float(r) for r in v)
    except (TypeError, ValueError):
        raise ConfigError(f"experiment: {where} must be a list of numbers, got {v!r}") from None


def _sweep(name: str, v) -> tuple:
    """``field: [values]`` or ``field: {values: [...], with: {other workload fields}}``."""
    if isinstance(v, dict):
        extra = set(v) - {"values", "with"}
        if extra:
            raise ConfigError(f"experiment: sweeps.{name}: unknown keys {sorted(extra)} (known: values, with)")
        return name, tuple(v.get("values") or ()), tuple(sorted((v.get("with") or {}).items()))
    return name, tuple(v or ()), ()


def load_experiment(path: str, overrides: tuple[str, ...] = ()) -> Experiment:
    """``overrides``: ``KEY=VALUE`` (a top-level key), ``workload.KEY=VALUE``, ``sim.KEY=VALUE``
    (every system's simulator option), ``systems.NAME.KEY=VALUE`` (one system's) or
    ``systems.NAME.autoscale.KEY=VALUE`` (its controller's policy), each VALUE
    read as YAML; applied before validation."""
    with open(path) as f:
        d = yaml.safe_load(f)
    return parse_experiment(apply_overrides(d, overrides))


def apply_overrides(d: dict, overrides: tuple[str, ...]) -> dict:
    d = dict(d or {})
    for text in overrides:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {text!r}: want KEY=VALUE")
        v = yaml.safe_load(value)
        scope, _, name = key.rpartition(".")
        if scope == "":
            if name in RATE_KEYS:  # whichever spelling the file used, the override replaces it
                d = {k: x for k, x in d.items() if k not in RATE_KEYS}
            d[name] = v
        elif scope == "workload":
            d["workload"] = {**(d.get("workload") or {}), name: v}
        elif scope == "sim":  # NOTE: YAML anchors share mappings; each system gets its own copy here
            d["systems"] = {n: {**s, "sim": {**(s.get("sim") or {}), name: v}} if isinstance(s, dict) else s
                            for n, s in (d.get("systems") or {}).items()}
        elif scope.startswith("systems.") and scope[len("systems."):] in (d.get("systems") or {}):
            n = scope[len("systems."):]
            d["systems"] = {**d["systems"], n: {**d["systems"][n], name: v}}
        elif (scope.startswith("systems.") and scope.endswith(".autoscale")
              and isinstance((d.get("systems") or {}).get(n := scope[len("systems."):-len(".autoscale")]), dict)):
            s = d["systems"][n]
            d["systems"] = {**d["systems"], n: {**s, "autoscale": {**(s.get("autoscale") or {}), name: v}}}
        else:
            raise ConfigError(f"override {text!r}: the key must be KEY, workload.KEY, sim.KEY, "
                              f"systems.NAME.KEY or systems.NAME.autoscale.KEY with NAME among "
                              f"{list(d.get('systems') or {})}")
    return d


