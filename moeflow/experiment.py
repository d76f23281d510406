"""An experiment file: one YAML that drives both the real engine and the simulator.

    model: tiny                       # the engine's model (a directory or "tiny"); the simulator's preset
    dtype: auto                       # what the deployments compute in (the simulator's cpu-here rates too)
    workload: {kind: production, length_scale: 0.25, duration_s: 40, seed: 0}
    rps: [0.3, 0.45]
    slo_ttft_s: 8
    systems:
      dep2: {mode: dep, dp: 2}
      asap: {mode: asap, attn_dp: 1, moe_workers: 1, comm_threads: false,
             engine: {num_kv_blocks: 4096},        # EngineConfig: limits the simulator honours too
             sim: {super_kernel: true}}           # SimOptions: the simulator's modelling choices
    hardware: cpu-here                 # simulator only, with cost / profile / machine / hardware_overrides

Each ``systems:`` entry is a layout (``moeflow.layout``: ``mode`` and that mode's fields, the
scheduler's fields accepted flat) plus two sub-configs. Everything is validated before anything
runs, and every random source takes its seed from here. Pure Python (the simulator reads it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import yaml

from moeflow.config import DTYPES, ConfigError, EngineConfig
from moeflow.layout import Layout, layout_from_dict
from moeflow.measure.workload import WorkloadConfig

COSTS = ("analytic", "profiled")
_ENGINE_KEYS_ELSEWHERE = ("model", "dtype")  # set once for the whole experiment


EXPERT_PLACEMENTS = ("contiguous", "eplb")
DSA_ATTENTION = ("mqa", "mha_short_batch", "mha_short_seqs")


@dataclass(frozen=True)
class SimOptions:
    """Modelling choices only the simulator has (the engine always does the real thing). Defaults
    are ASAP's stated setup where the paper states one; docs/simulator.md gives each one's source."""

    super_kernel: bool = True  # layer-oblivious MoE kernel; False pays host_dispatch_s per MoE layer
    # whether the device runs the layout's communication threads/streams concurrently with its
    # compute; False where they share one CPU core with the experts (this machine)
    comm_overlap: bool = True
    # Expert-load skew (sim/expert_load.py). 0: every expert device gets exactly its share of every
    # layer's (token, expert) pairs (ASAP Fig. 3b's "perfect expert load balancing"). > 0: per MoE
    # layer, expert popularity ~ Dirichlet with this coefficient of variation across experts, each
    # batch's pairs ~ Multinomial over the devices; every all-to-all and MoE step is priced by its
    # most loaded receiver.
    expert_load_cv: float = 0.0
    expert_placement: str = "contiguous"  # or "eplb": DeepSeek-V3 §3.4, one redundant expert per device
    expert_seed: int = 0  # popularity and per-batch draws (the same popularity for every system)
    # DSA's core attention (sim/attention_cost.py): "mqa" absorbed MLA over the selected keys at every
    # length (vllm-ascend SFA, CANN's DeepSeek-V3.2 recipe); "mha_short_batch" masked MHA for a batch
    # whose longest context <= index_topk (SGLang); "mha_short_seqs" the same decided per sequence
    dsa_attention: str = "mqa"
    # under attention TP the MLA down-projections and the DSA indexer run on every TP rank (vLLM,
    # SGLang, vllm-ascend shard DeepSeek so); False: everything split T ways
    tp_replicates: bool = True
    a2a_bw_GBps: float | None = None  # the baselines' all-to-all (None: the hardware preset's a2a_bw_Bps)
    seed: int = 0  # the simulator's own random draws (dwdp: contention levels of naive pulls)
    # dep: the all-to-all sends a token once per remote device holding any of its experts (DeepEP's
    # layout) instead of once per (token, expert) pair (moeflow's engine)
    dedup_dispatch: bool = False
    # more worker processes than the profiled machine's cores: a compute stage waits for a free core
    # (sim/cores.py); False: every process computes as if it had a core of its own
    core_sharing: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"sim: {msg}")

        for f in ("super_kernel", "comm_overlap", "tp_replicates", "dedup_dispatch", "core_sharing"):
            need(isinstance(getattr(self, f), bool), f"{f} must be true or false, got {getattr(self, f)!r}")
        need(isinstance(self.expert_load_cv, (int, float)) and 0 <= self.expert_load_cv < 8,
             f"expert_load_cv must be in [0, 8), got {self.expert_load_cv!r}")
        need(self.expert_placement in EXPERT_PLACEMENTS,
             f"expert_placement must be one of {EXPERT_PLACEMENTS}, got {self.expert_placement!r}")
        for f in ("expert_seed", "seed"):
            need(isinstance(getattr(self, f), int), f"{f} must be an integer, got {getattr(self, f)!r}")
        need(self.dsa_attention in DSA_ATTENTION,
             f"dsa_attention must be one of {DSA_ATTENTION}, got {self.dsa_attention!r}")
        need(self.a2a_bw_GBps is None or (isinstance(self.a2a_bw_GBps, (int, float)) and self.a2a_bw_GBps > 0),
             f"a2a_bw_GBps must be a number > 0, got {self.a2a_bw_GBps!r}")


@dataclass(frozen=True)
class SystemSpec:
    """One system of an experiment: a layout, the engine's settings and the simulator's options."""

    name: str
    layout: Layout
    engine: EngineConfig  # the engine uses all of it; the simulator its KV-cache and sequence limits
    sim: SimOptions = field(default_factory=SimOptions)

    @property
    def kv_tokens_per_group(self) -> int:
        """KV-cache capacity of one attention group (or rank), in tokens."""
        return self.engine.num_kv_blocks * self.engine.kv_block_size


@dataclass(frozen=True)
class Experiment:
    model: str  # the engine's model (a Hugging Face directory or "tiny"); the simulator's model preset
    systems: dict[str, SystemSpec]
    workload: WorkloadConfig  # rate_rps is set per probe
    dtype: str = "auto"
    rps: tuple[float, ...] = (1.0,)
    slo_ttft_s: float | None = None
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
    # simulator only
    hardware: str | None = None  # hardware preset (sim/hardware.py)
    cost: str = "analytic"
    profile: str | None = None  # profiled cost: the JSON ``moeflow profile`` wrote
    machine: str | None = None  # hardware cpu-here: the `moeflow env --json` report of that machine
    hardware_overrides: tuple[tuple[str, float], ...] = ()
    # workload fields swept one at a time, each value at saturation_rps (sim/sweep.py), e.g. DWDP's
    # Table 3a/3c: {isl: [1024, ...], isl_std: {values: [0, ...], with: {kind: normal}}}; per sweep:
    # (field, values, other workload fields it sets)
    sweeps: tuple[tuple[str, tuple[float, ...], tuple[tuple[str, object], ...]], ...] = ()
    roofline_isl: tuple[int, ...] = ()  # dwdp systems: DWDP §3's per-layer roofline at these prompt lengths

    def point_workload(self, rate: float, seed: int, num_requests: int | None = None) -> WorkloadConfig:
        """The workload of one point at ``rate`` with ``seed``, for the engine and the simulator alike:
        the configured window, grown to hold ``min_requests`` where the rate is too low for it."""
        w = dataclasses.replace(self.workload, rate_rps=rate, seed=seed)
        n = num_requests or w.num_requests
        if n is None and w.duration_s is not None and rate * w.duration_s < self.min_requests:
            n = self.min_requests
        return dataclasses.replace(w, num_requests=n, duration_s=None) if n else w

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"experiment: {msg}")

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.cost in COSTS, f"cost must be one of {COSTS}, got {self.cost!r}")
        need(self.cost != "profiled" or bool(self.profile), "cost: profiled needs profile: FILE.json")
        need(bool(self.systems), "systems: give at least one")
        need(all(r > 0 for r in self.rps), f"rps must all be > 0, got {list(self.rps)}")
        need(not self.find_slo_rps or (self.slo_ttft_s or 0) > 0, "find_slo_rps needs slo_ttft_s > 0")
        from moeflow.measure.slo import SloMetric

        SloMetric.parse(self.slo_metric)
        need(isinstance(self.repeats, int) and self.repeats >= 1, f"repeats must be >= 1, got {self.repeats!r}")
        need(self.saturation_rps is None or self.saturation_rps > 0, "saturation_rps must be > 0")
        for a, b in self.compare:
            need(a in self.systems and b in self.systems, f"compare: {a!r} vs {b!r}: both must be systems")
        workload_fields = set(WorkloadConfig.__dataclass_fields__) - {"kind", "rate_rps", "trace_path"}
        for name, values, others in self.sweeps:
            need(name in workload_fields, f"sweeps: {name!r} is not a workload field ({sorted(workload_fields)})")
            need(bool(values), f"sweeps.{name}: give at least one value")
            need(all(k in WorkloadConfig.__dataclass_fields__ for k, _ in others),
                 f"sweeps.{name}.with: unknown workload fields {[k for k, _ in others]}")
        need(not self.sweeps or self.saturation_rps is not None, "sweeps run at saturation_rps: set it")
        need(all(isinstance(n, int) and n > 0 for n in self.roofline_isl), "roofline_isl: positive ints")


def _pick(cls, d: dict, where: str, exclude: tuple[str, ...] = ()) -> dict:
    known = {f.name for f in fields(cls)} - set(exclude)
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"experiment: unknown keys in {where}: {sorted(unknown)} (known: {sorted(known)})")
    return d


def system_from_dict(name: str, d: dict, model: str = "tiny", dtype: str = "auto") -> SystemSpec:
    """One ``systems:`` entry, as both the engine and the simulator read it."""
    if not isinstance(d, dict):
        raise ConfigError(f"experiment: systems.{name} must be a mapping, got {d!r}")
    d = dict(d)
    engine = _pick(EngineConfig, dict(d.pop("engine", None) or {}), f"systems.{name}.engine", _ENGINE_KEYS_ELSEWHERE)
    sim = _pick(SimOptions, dict(d.pop("sim", None) or {}), f"systems.{name}.sim")
    return SystemSpec(name, layout_from_dict(d, f"systems.{name}"), EngineConfig(model=model, dtype=dtype, **engine),
                      SimOptions(**sim))


def _number(v, where: str) -> float:
    # NOTE: YAML 1.1 reads 28e9 (no dot, no sign) as a string; accept what float() accepts
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"experiment: {where} must be a number, got {v!r}") from None


def parse_experiment(d: dict) -> Experiment:
    if not isinstance(d, dict):
        raise ConfigError("experiment: the file must hold a mapping")
    d = dict(_pick(Experiment, d, "the top level"))
    for key in ("model", "systems", "workload"):
        if key not in d:
            raise ConfigError(f"experiment: missing {key!r}")
    model, dtype = d["model"], d.get("dtype", "auto")
    d["systems"] = {n: system_from_dict(n, s, model, dtype) for n, s in (d["systems"] or {}).items()}
    w = dict(_pick(WorkloadConfig, d["workload"] or {}, "workload"))
    w.setdefault("rate_rps", 1.0)
    d["workload"] = WorkloadConfig(**w)
    d["hardware_overrides"] = tuple(sorted((k, _number(v, f"hardware_overrides.{k}"))
                                           for k, v in (d.get("hardware_overrides") or {}).items()))
    d["rps"] = tuple(float(r) for r in d["rps"]) if d.get("rps") is not None else (1.0,)  # []: saturation only
    d["compare"] = tuple(tuple(pair) for pair in (d.get("compare") or ()))
    d["sweeps"] = tuple(_sweep(k, v) for k, v in (d.get("sweeps") or {}).items())
    d["roofline_isl"] = tuple(d.get("roofline_isl") or ())
    return Experiment(**d)


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
    (every system's simulator option) or ``systems.NAME.KEY=VALUE`` (one system's), each VALUE
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
            d[name] = v
        elif scope == "workload":
            d["workload"] = {**(d.get("workload") or {}), name: v}
        elif scope == "sim":  # NOTE: YAML anchors share mappings; each system gets its own copy here
            d["systems"] = {n: {**s, "sim": {**(s.get("sim") or {}), name: v}} if isinstance(s, dict) else s
                            for n, s in (d.get("systems") or {}).items()}
        elif scope.startswith("systems.") and scope[len("systems."):] in (d.get("systems") or {}):
            n = scope[len("systems."):]
            d["systems"] = {**d["systems"], n: {**d["systems"][n], name: v}}
        else:
            raise ConfigError(f"override {text!r}: the key must be KEY, workload.KEY, sim.KEY or "
                              f"systems.NAME.KEY with NAME among {list(d.get('systems') or {})}")
    return d


def system_to_dict(spec: SystemSpec) -> dict:
    """The entry's settings as a result file records them."""
    from moeflow.layout import layout_to_dict

    engine = {k: v for k, v in dataclasses.asdict(spec.engine).items() if k not in _ENGINE_KEYS_ELSEWHERE}
    return {**layout_to_dict(spec.layout), "engine": engine, "sim": dataclasses.asdict(spec.sim)}
