"""The question ``moeflow plan`` answers: which deployment of N devices serves this workload within
this SLO at the most requests per second per device; or, given a rate that drifts over time
(``rps`` with its curves), which deployment, fixed or elastic, serves that trace with the most good
requests per device-second (``plan/drift.py``). The command line fills it in (``plan/cli.py``); a
caller such as the demo asks it directly (``plan.cli.answer``)."""
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
    # the drifting question: arrivals at rps x rate_curve(t) for duration_s, prompts x length_curve(t)
    # (knots [(t_s, factor), ...], measure/drift.py); None: the stationary question above
    rps: float | None = None
    rate_curve: tuple[tuple[float, float], ...] = ()
    length_curve: tuple[tuple[float, float], ...] = ()
    duration_s: float = 300.0
    repeats: int = 1  # seeds each drifting candidate is simulated with (the verdict: their median)

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
        self._check_drift()
        if self.max_batch_tokens is not None and self.max_batch_tokens < self.isl:
            raise ConfigError(f"--max-batch-tokens {self.max_batch_tokens} is below --isl {self.isl}: a prompt would not fit")

    def experiment_base(self, isl: int, preset: str | None) -> dict:
        """The experiment (config mapping) of one stationary probe with prompts up to ``isl`` long, on
        ``preset`` (the hardware choice's default) or this machine's profile."""
        target = ({"hardware": "cpu-here", "cost": "profiled", "profile": self.profile} if self.profile
                  else {"hardware": preset})
        workload = {"kind": "fixed", "fixed_len": isl} if self.isl_ratio == 1 else \
            {"kind": "uniform", "isl": isl, "isl_ratio": self.isl_ratio}
        base = {"model": self.model, **target, "slo_ttft_s": self.ttft_s, "slo_metric": self.percentile,
                "workload": {**workload, "output_len": self.osl, "num_requests": self.num_requests, "seed": 0}}
        if self.tpot_ms is not None:
            base["slo_tpot_s"] = self.tpot_ms / 1e3
        return base

    @property
    def drifts(self) -> bool:
        return self.rps is not None

    def _check_drift(self) -> None:
        from moeflow.measure.drift import check_curve

        if not self.drifts:
            if self.rate_curve or self.length_curve:
                raise ConfigError("--rate-curve and --length-curve shape a rate: give --request-rate too")
            return
        if not self.rps > 0:
            raise ConfigError(f"--request-rate must be > 0, got {self.rps}")
        if not self.duration_s > 0:
            raise ConfigError(f"--duration-s must be > 0, got {self.duration_s}")
        if self.tpot_ms is None:
            raise ConfigError("--request-rate asks which deployment, fixed or elastic, serves a drifting trace: give --tpot-ms "
                              "(the controllers keep a TPOT SLO, and good requests meet both bounds)")
        if not (isinstance(self.repeats, int) and self.repeats >= 1):
            raise ConfigError(f"--repeats must be an int >= 1, got {self.repeats!r}")
        for name in ("rate_curve", "length_curve"):
            try:
                object.__setattr__(self, name, check_curve(getattr(self, name), "--" + name.replace("_", "-")))
            except ValueError as e:
                raise ConfigError(str(e)) from None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanQuestion":
        given = {k: getattr(args, k) for k in cls.__dataclass_fields__}
        return cls(**{**given, "kinds": tuple(k.strip() for k in args.kinds.split(",")),
                      "include": tuple(args.include), "rate_curve": parse_curve(args.rate_curve, "--rate-curve"),
                      "length_curve": parse_curve(args.length_curve, "--length-curve")})


def parse_curve(text: str | None, flag: str) -> tuple[tuple[float, float], ...]:
    """'0:1,100:3,200:1' -> ((0.0, 1.0), (100.0, 3.0), (200.0, 1.0)): knots t_s:factor."""
    if not text:
        return ()
    knots = []
    for part in text.split(","):
        t, _, f = part.strip().partition(":")
        try:  # a knot without its colon leaves f empty: not a number either
            knots.append((float(t), float(f)))
        except ValueError:
            raise ConfigError(f"{flag}: each knot is T_S:FACTOR (e.g. 0:1,100:3), got {part.strip()!r}") from None
    return tuple(knots)
