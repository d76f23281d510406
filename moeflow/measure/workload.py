"""Seeded request workloads: arrival times and prompt lengths, shared by ``bench serve`` and ``sim``.

Pure Python + numpy (no torch): the simulator imports this module.

Arrivals are a renewal process at ``rate_rps``: exponential gaps (Poisson) when ``burstiness`` is
1, otherwise gamma gaps with shape ``burstiness`` and mean 1/rate (vLLM's convention: the CV of
the gaps is 1/sqrt(burstiness), so < 1 is burstier). Prompt lengths come from one of the kinds:

- ``production``: ASAP §2.3's heavy-tailed trace (mean ~5k, minimum 31, tail toward 100k) with
  requests above 32k left out (§5.1): a lognormal restricted to [31, 32768]; fit in
  ``production_lengths.py`` and docs/bench_serve.md. ``production_mean`` says which mean is
  5k: ``kept`` (the default, what every committed measurement used) fits the mean of the requests
  that remain after the 32k cut; ``raw`` fits the mean of the whole trace before it, which is how
  §2.3 states it (the kept mean is then ~4.2k).
- ``uniform``: integers in [r·ISL, ISL] (DWDP's "ISL ratio" r).
- ``normal``: mean ISL, standard deviation ``isl_std`` (DWDP Table 3c's "ISL/STD"), rounded;
  draws outside [1, 2·ISL] are redrawn, so the mean stays ISL.
- ``fixed``: every prompt ``fixed_len`` tokens.
- ``trace``: a JSONL file, one request per line: ``arrival_s``, ``prompt_len``, optional ``output_len``.

``length_scale`` multiplies every prompt length last (after the 32k cap; at least 1 token), to
shrink a workload to a small machine. Arrival gaps and lengths draw from separate seeded streams,
so the same seed gives the same length sequence at every rate (common random numbers).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from moeflow.measure.drift import check_curve, curve_at, curve_integral, warp_arrivals
from moeflow.measure.production_lengths import PRODUCTION_MEANS, restricted_draws, sample_production_lens

KINDS = ("production", "uniform", "normal", "fixed", "trace")

DEFAULT_DURATION_S = 60.0  # bench serve: arrivals per rate when neither a duration nor a count is given


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float  # seconds after the start of the replay
    prompt_len: int
    output_len: int  # tokens to generate (1: prefill only)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "production"
    rate_rps: float | None = None  # mean arrival rate; trace: rescale its times to this rate (None: as recorded)
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 = Poisson
    duration_s: float | None = None  # arrivals in [0, duration_s) ...
    num_requests: int | None = None  # ... and/or at most this many requests
    length_scale: float = 1.0
    isl: int | None = None  # uniform: the longest prompt
    isl_ratio: float = 0.5  # uniform: the shortest prompt is isl_ratio * isl
    isl_std: float = 0.0  # normal: standard deviation of the prompt length around isl
    fixed_len: int | None = None
    production_mean: str = "kept"  # production: which mean is 5k, "kept" (after the 32k cut) or "raw" (§2.3)
    trace_path: str | None = None
    output_len: int = 1  # trace lines may override it
    output_len_max: int | None = None  # output lengths uniform in [output_len, output_len_max] (None: all output_len)
    seed: int = 0
    # a workload that drifts (drift.py): [(t_s, factor), ...] knots, linear between, flat beyond; the
    # arrival rate is rate_rps x rate_curve(t), each prompt's length x length_curve(its arrival)
    rate_curve: tuple[tuple[float, float], ...] = ()
    length_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"WorkloadConfig: {msg}")

        need(self.kind in KINDS, f"kind must be one of {KINDS}, got {self.kind!r}")
        need(self.rate_rps is None or self.rate_rps > 0, f"rate_rps must be > 0, got {self.rate_rps}")
        need(self.kind == "trace" or self.rate_rps is not None, f"kind {self.kind!r} needs rate_rps")
        need(self.burstiness > 0, f"burstiness must be > 0, got {self.burstiness}")
        need(self.duration_s is None or self.duration_s > 0, f"duration_s must be > 0, got {self.duration_s}")
        need(self.num_requests is None or self.num_requests > 0,
             f"num_requests must be > 0, got {self.num_requests}")
        need(self.kind == "trace" or self.duration_s is not None or self.num_requests is not None,
             "give duration_s or num_requests")
        need(self.length_scale > 0, f"length_scale must be > 0, got {self.length_scale}")
        need(self.output_len >= 1, f"output_len must be >= 1, got {self.output_len}")
        need(self.output_len_max is None or self.output_len_max >= self.output_len,
             f"output_len_max must be >= output_len ({self.output_len}), got {self.output_len_max}")
        if self.kind == "uniform":
            need(self.isl is not None and self.isl >= 1, f"uniform needs isl >= 1, got {self.isl}")
            need(0 <= self.isl_ratio <= 1, f"isl_ratio must be in [0, 1], got {self.isl_ratio}")
        need(self.production_mean in PRODUCTION_MEANS,
             f"production_mean must be one of {PRODUCTION_MEANS}, got {self.production_mean!r}")
        if self.kind == "normal":
            need(self.isl is not None and self.isl >= 1, f"normal needs isl >= 1, got {self.isl}")
            need(self.isl_std >= 0, f"isl_std must be >= 0, got {self.isl_std}")
        if self.kind == "fixed":
            need(self.fixed_len is not None and self.fixed_len >= 1,
                 f"fixed needs fixed_len >= 1, got {self.fixed_len}")
        if self.kind == "trace":
            need(bool(self.trace_path), "trace needs trace_path")
        for name in ("rate_curve", "length_curve"):
            try:
                object.__setattr__(self, name, check_curve(getattr(self, name), name))
            except ValueError as e:
                need(False, str(e))
            need(not getattr(self, name) or self.kind != "trace", f"{name}: a trace keeps its own times and lengths")
        need(not self.rate_curve or self.duration_s is not None, "rate_curve needs duration_s (the span it shapes)")

    def to_dict(self) -> dict:
        return asdict(self)


def generate_requests(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    """The workload's requests in arrival order; the same config always gives the same list."""
    if cfg.kind == "trace":
        reqs = _trace_requests(cfg)
    else:
        arrival_rng, length_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(2))
        arrivals = _arrivals(arrival_rng, cfg)
        if cfg.rate_curve:  # drawn at rate_rps in the curve's own time, then mapped to the clock
            arrivals = warp_arrivals(arrivals, cfg.rate_curve, cfg.duration_s)
        lens = _lengths(length_rng, cfg, len(arrivals))
        if cfg.length_curve:
            lens = np.maximum(1, np.rint(lens * curve_at(cfg.length_curve, arrivals))).astype(np.int64)
        outs = [cfg.output_len] * len(arrivals)
        if cfg.output_len_max is not None:  # its own stream: the arrivals and prompts stay those of output_len alone
            out_rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[2])
            outs = out_rng.integers(cfg.output_len, cfg.output_len_max, len(arrivals), endpoint=True).tolist()
        reqs = [WorkloadRequest(float(a), int(n), int(o)) for a, n, o in zip(arrivals, lens, outs)]
    return [WorkloadRequest(r.arrival_s, scale_len(r.prompt_len, cfg.length_scale), r.output_len) for r in reqs]


def workload_config(args: argparse.Namespace, rate_rps: float | None) -> WorkloadConfig:
    """The workload ``bench serve``'s flags describe (in-process and over HTTP alike), at ``rate_rps``."""
    duration = args.duration_s
    if duration is None and args.workload != "trace" and args.num_prompts is None:
        duration = DEFAULT_DURATION_S
    return WorkloadConfig(kind=args.workload, rate_rps=rate_rps, burstiness=args.burstiness, duration_s=duration,
                          num_requests=args.num_prompts,
                          length_scale=args.length_scale, isl=args.isl, isl_ratio=args.isl_ratio,
                          fixed_len=args.fixed_len, trace_path=args.trace_file, output_len=args.max_tokens,
                          seed=args.seed)


def parse_rates(text: str | None, kind: str) -> list[float | None]:
    """Comma-separated request rates; none given: 1 rps, a trace at its recorded times (None)."""
    if text is None:
        return [None] if kind == "trace" else [1.0]
    return rates_of(text)


def rates_of(text: str) -> list[float]:
    """``--request-rate``'s comma-separated rates (req/s), each a positive number."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: expected comma-separated numbers, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"--request-rate: rates must be positive numbers, got {text!r}")
    return rates


def scale_len(prompt_len: int, length_scale: float) -> int:
    return max(1, round(prompt_len * length_scale))


def _arrivals(rng: np.random.Generator, cfg: WorkloadConfig) -> np.ndarray:
    mean_gap = 1.0 / cfg.rate_rps
    limit = cfg.num_requests
    span = cfg.duration_s if not cfg.rate_curve else curve_integral(cfg.rate_curve, cfg.duration_s)
    if limit is None:  # enough gaps to pass the span with overwhelming probability, then cut
        limit = int(span * cfg.rate_rps + 10 * math.sqrt(span * cfg.rate_rps / cfg.burstiness) + 10)
    if cfg.burstiness == 1.0:
        gaps = rng.exponential(mean_gap, limit)
    else:
        gaps = rng.gamma(cfg.burstiness, mean_gap / cfg.burstiness, limit)
    times = np.cumsum(gaps)
    if cfg.duration_s is not None:
        times = times[times < span]
    return times


def _lengths(rng: np.random.Generator, cfg: WorkloadConfig, n: int) -> np.ndarray:
    if cfg.kind == "fixed":
        return np.full(n, cfg.fixed_len, dtype=np.int64)
    if cfg.kind == "uniform":
        lo = max(1, math.ceil(cfg.isl_ratio * cfg.isl))
        return rng.integers(lo, cfg.isl, n, endpoint=True)
    if cfg.kind == "normal":
        # outside [1, 2·ISL] redrawn: symmetric, so the mean stays ISL
        return restricted_draws(lambda k: rng.normal(cfg.isl, cfg.isl_std, k), 1, 2 * cfg.isl, n)
    return sample_production_lens(rng, n, cfg.production_mean)


def _trace_requests(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    reqs = read_trace(cfg.trace_path, cfg.output_len)
    if cfg.rate_rps is not None and len(reqs) > 1:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        if span > 0:  # stretch time so the mean rate is rate_rps; the burst pattern is kept
            k = (len(reqs) - 1) / span / cfg.rate_rps
            t0 = reqs[0].arrival_s
            reqs = [WorkloadRequest(t0 + (r.arrival_s - t0) * k, r.prompt_len, r.output_len) for r in reqs]
    if cfg.duration_s is not None:
        reqs = [r for r in reqs if r.arrival_s < cfg.duration_s]
    return reqs[:cfg.num_requests] if cfg.num_requests is not None else reqs


def read_trace(path: str, default_output_len: int = 1) -> list[WorkloadRequest]:
    """A JSONL trace, sorted by arrival; a bad line raises ``ValueError`` naming the file and line."""
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue

            def bad(msg: str) -> ValueError:
                return ValueError(f"{path}:{lineno}: {msg}")

            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise bad(f"not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise bad(f"expected an object, got {type(row).__name__}")
            unknown = set(row) - {"arrival_s", "prompt_len", "output_len"}
            if unknown:
                raise bad(f"unknown field(s) {sorted(unknown)}")
            for name in ("arrival_s", "prompt_len"):
                if name not in row:
                    raise bad(f"missing {name!r}")
            t = row["arrival_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                raise bad(f"arrival_s must be a finite number >= 0, got {t!r}")
            for name in ("prompt_len", "output_len"):
                v = row.get(name, 1)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise bad(f"{name} must be an integer >= 1, got {v!r}")
            reqs.append(WorkloadRequest(float(t), row["prompt_len"], row.get("output_len", default_output_len)))
    if not reqs:
        raise ValueError(f"{path}: the trace has no requests")
    reqs.sort(key=lambda r: r.arrival_s)  # stable: equal times keep file order
    return reqs
