"""The question ``moeflow plan`` answers: which deployment of N devices serves this workload within
this SLO at the most requests per second per device. The command line fills it in
(``plan/cli.py``); a caller such as the demo asks it directly (``plan.cli.answer``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from moeflow.config import ConfigError

KINDS = ("aggregated", "pd")
PERCENTILES = ("mean", "p50", "p90")
RANK_BY = ("device", "cost")


@dataclass(frozen=True)
class PlanQuestion:
    model: str  # a model preset of the simulator (or a checkpoint directory)
    devices: int  # devices (processes) the deployment may use
    isl: int  # prompt tokens per request (uniform down to isl * isl_ratio)
    osl: int  # output tokens per request
    ttft_s: float  # TTFT bound at `percentile`
    hardware: str | None = None  # a hardware preset (sim/hardware.py): the analytic cost
    profile: str | None = None  # this machine's `moeflow profile` JSON: the profiled cost instead
    isl_ratio: float = 1.0  # shortest prompt / longest
    tpot_ms: float | None = None  # TPOT bound at `percentile` (None: TTFT only)
    percentile: str = "p90"  # of TTFT and TPOT
    kinds: tuple[str, ...] = KINDS  # which deployments are candidates: aggregated, pd or both
    max_batch_tokens: int | None = None  # every layout's batch limit (None: each mode's own)
    mem_fraction: float = 0.9  # share of a device's memory a process may hold
    num_requests: int = 100  # requests per simulated probe
    start_rps: float | None = None  # the search's first rate (None: per candidate, one over a lone request's latency)
    jobs: int = 2  # candidates simulated at once (processes)
    confirm: int = 8  # at most this many candidates simulated whole after their estimates
    top: int = 3  # the best this many are all simulated whole
    include: tuple[str, ...] = ()  # candidates simulated whole whatever their estimate
    price: str | None = None  # PRESET=USD per device-hour, comma-separated (sim/prices.py's defaults otherwise)
    rank_by: str = "device"  # goodput per device, or per USD ("cost")

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {self.devices}")
        if (self.hardware is None) == (self.profile is None):
            raise ConfigError("give one of --hardware PRESET (the analytic cost) or --profile P.json (the profiled cost "
                              "of the machine that measured it)")
        if not self.kinds or not set(self.kinds) <= set(KINDS):
            raise ConfigError(f"--kinds: aggregated and/or pd, got {','.join(self.kinds)!r}")
        if self.percentile not in PERCENTILES:
            raise ConfigError(f"--percentile must be one of {PERCENTILES}, got {self.percentile!r}")
        if self.rank_by not in RANK_BY:
            raise ConfigError(f"--rank-by must be one of {RANK_BY}, got {self.rank_by!r}")
        if self.profile is not None and (self.price or self.rank_by == "cost"):
            raise ConfigError("--price and --rank-by cost price hardware presets: give --hardware, not --profile")
        if self.max_batch_tokens is not None and self.max_batch_tokens < self.isl:
            raise ConfigError(f"--max-batch-tokens {self.max_batch_tokens} is below --isl {self.isl}: a prompt would not fit")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanQuestion":
        given = {k: getattr(args, k) for k in cls.__dataclass_fields__}
        return cls(**{**given, "kinds": tuple(k.strip() for k in args.kinds.split(",")),
                      "include": tuple(args.include)})
