"""The end-to-end disaggregated experiment file: context servers of several kinds compared as the
prefill side of a prefill/decode deployment, each paired with a sweep of generation servers, the
instance counts chosen by rate matching (``sim/rate_match.py``). DWDP §5.3's Pareto is one:

    model: deepseek-r1
    hardware: gb200
    workload: {kind: uniform, isl: 8192, isl_ratio: 0.8, output_len: 1024, num_requests: 512, seed: 0}
    systems:                         # the context servers (a serving experiment's systems)
      dep4: {mode: dep, dp: 4, ...}
      dwdp4: {mode: dwdp, dp: 4, ...}
    e2e:
      baseline: dep4
      devices: 72                    # the domain both sides share
      max_prefill_utilization: 0.9
      decode:                        # the generation servers, each at every batch of the sweep
        gen_dep16: {mode: dep, dp: 16, engine: {memory_budget_gib: 160}}
      decode_batches: [1, 2, 4, 8, 16, 32, 64, 128, 256]   # requests per attention group
      band_tps_user: [20, 30]        # where the headline ratios are read
      range_tps_user: [20, 100]      # where the mean gain is read
      paper: {tps_per_device_band: 1.10}   # printed beside the simulated ratios

A file with ``e2e:`` is one of these (``moeflow simulate --config``). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeflow.config import ConfigError
from moeflow.experiment.serve import RATE_KEYS, Experiment, parse_experiment
from moeflow.experiment.system import SystemSpec, field_names, pick_keys, system_from_dict


@dataclass(frozen=True)
class E2eSection:
    baseline: str
    decode: dict[str, SystemSpec]
    devices: int
    decode_batches: tuple[int, ...]
    band_tps_user: tuple[float, float] = (20.0, 30.0)
    range_tps_user: tuple[float, float] = (20.0, 100.0)
    max_prefill_utilization: float = 0.9
    decode_context: int | None = None  # None: the mean prompt plus half the output (the decode batch's mean)
    decode_steps: int = 4
    decode_warmup_steps: int = 1
    ttft_requests: int = 256  # requests per TTFT run at a front point's prefill rate
    paper: dict = field(default_factory=dict)  # the published ratios, printed beside the simulated ones


@dataclass(frozen=True)
class E2eExperiment:
    experiment: Experiment  # the context servers, the workload, the target
    e2e: E2eSection

    def __post_init__(self) -> None:
        e, x = self.e2e, self.experiment

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"e2e: {msg}")

        need(e.baseline in x.systems, f"baseline {e.baseline!r} is not among the systems {sorted(x.systems)}")
        need(len(x.systems) >= 2, "give at least two context systems to compare (the baseline and another)")
        need(bool(e.decode), "decode: give at least one generation system")
        need(all(s.layout.mode in ("dep", "afd") for s in e.decode.values()),
             "decode: generation systems are dep or afd (the modes the simulator measures decode for)")
        need(all(s.engine.memory_budget_gib for s in e.decode.values()),
             "decode: each generation system needs engine.memory_budget_gib (its batch must fit its KV)")
        need(bool(e.decode_batches) and all(isinstance(b, int) and b >= 1 for b in e.decode_batches),
             f"decode_batches: positive ints, got {list(e.decode_batches)}")
        need(isinstance(e.devices, int) and e.devices >= 2, f"devices must be an int >= 2, got {e.devices!r}")
        need(0 < e.max_prefill_utilization <= 1, f"max_prefill_utilization in (0, 1], got {e.max_prefill_utilization}")
        for name, pair in (("band_tps_user", e.band_tps_user), ("range_tps_user", e.range_tps_user)):
            need(len(pair) == 2, f"{name}: [lo, hi], got {list(pair)}")
            lo, hi = pair
            need(0 < lo < hi, f"{name}: [lo, hi] with 0 < lo < hi, got {[lo, hi]}")
        known = {"tps_per_device_band", "tps_per_device_range", "tps_user_band"}
        need(set(e.paper) <= known, f"paper: unknown ratios {sorted(set(e.paper) - known)} (known: {sorted(known)})")
        need((x.workload.output_len or 0) > 1, "the workload needs output_len > 1 (TPS/user is per output token)")


def parse_e2e(d: dict) -> E2eExperiment:
    d = dict(d)
    raw = d.pop("e2e")
    if not isinstance(raw, dict):
        raise ConfigError("e2e: a mapping")
    raw = dict(pick_keys(raw, field_names(E2eSection), "e2e"))
    for key in ("baseline", "decode", "devices", "decode_batches"):
        if key not in raw:
            raise ConfigError(f"e2e: missing {key!r}")
    model, dtype = d.get("model", "tiny"), d.get("dtype", "auto")
    raw["decode"] = {n: system_from_dict(n, s, model, dtype) for n, s in (raw["decode"] or {}).items()}
    raw["decode_batches"] = tuple(raw["decode_batches"] or ())
    for key in ("band_tps_user", "range_tps_user"):
        if key in raw:
            raw[key] = tuple(float(v) for v in raw[key])
    if not any(k in d for k in RATE_KEYS):
        d["rps"] = []
    return E2eExperiment(parse_experiment(d), E2eSection(**raw))
