"""Seeded request workloads: arrival times and prompt lengths, shared by ``bench serve`` and ``sim``.

Pure Python + numpy (no torch): the simulator imports this module.

Arrivals are a renewal process at ``rate_rps``: exponential gaps (Poisson) when ``burstiness`` is
1, otherwise gamma gaps with shape ``burstiness`` and mean 1/rate (vLLM's convention: the CV of
the gaps is 1/sqrt(burstiness), so < 1 is burstier). Prompt lengths come from one of the kinds:

- ``production``: ASAP §2.3's heavy-tailed trace (mean ~5k, minimum 31, tail toward 100k) with
  requests above 32k left out (§5.1): a lognormal restricted to [31, 32768]; fit in
  ``fit_production_lognormal`` and docs/bench_serve.md. ``production_mean`` says which mean is
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
from statistics import NormalDist

import numpy as np

KINDS = ("production", "uniform", "normal", "fixed", "trace")

PRODUCTION_MIN_LEN = 31  # shortest prompt in ASAP's trace (§2.3)
PRODUCTION_MAX_LEN = 32768  # ASAP §5.1 leaves out requests above 32k
PRODUCTION_MEAN_LEN = 5000  # mean prompt length of ASAP's trace (§2.3)
PRODUCTION_TAIL_LEN = 100_000  # "a heavy tail extending up to 100k" ...
PRODUCTION_TAIL_QUANTILE = 0.999  # ... read as: 0.1% of the raw trace lies above it
# ln(tokens) ~ Normal(mu, sigma) before the restriction to [31, 32768]; fitted by
# fit_production_lognormal(mean_of) (a unit test re-runs both fits).
PRODUCTION_LOG_MU = 8.052101  # "kept": the mean after the 32k cut is 5k; median e^mu = 3140 tokens
PRODUCTION_LOG_SIGMA = 1.119924
PRODUCTION_RAW_LOG_MU = 7.792208  # "raw": the mean of the whole trace is 5k (kept mean 4221); median e^mu = 2422
PRODUCTION_RAW_LOG_SIGMA = 1.204025
PRODUCTION_MEANS = ("kept", "raw")
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

    def to_dict(self) -> dict:
        return asdict(self)


def generate_requests(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    """The workload's requests in arrival order; the same config always gives the same list."""
    if cfg.kind == "trace":
        reqs = _trace_requests(cfg)
    else:
        arrival_rng, length_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(2))
        arrivals = _arrivals(arrival_rng, cfg)
        lens = _lengths(length_rng, cfg, len(arrivals))
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
    if limit is None:  # enough gaps to pass duration_s with overwhelming probability, then cut
        limit = int(cfg.duration_s * cfg.rate_rps + 10 * math.sqrt(cfg.duration_s * cfg.rate_rps / cfg.burstiness) + 10)
    if cfg.burstiness == 1.0:
        gaps = rng.exponential(mean_gap, limit)
    else:
        gaps = rng.gamma(cfg.burstiness, mean_gap / cfg.burstiness, limit)
    times = np.cumsum(gaps)
    if cfg.duration_s is not None:
        times = times[times < cfg.duration_s]
    return times


def _lengths(rng: np.random.Generator, cfg: WorkloadConfig, n: int) -> np.ndarray:
    if cfg.kind == "fixed":
        return np.full(n, cfg.fixed_len, dtype=np.int64)
    if cfg.kind == "uniform":
        lo = max(1, math.ceil(cfg.isl_ratio * cfg.isl))
        return rng.integers(lo, cfg.isl, n, endpoint=True)
    if cfg.kind == "normal":
        # outside [1, 2·ISL] redrawn: symmetric, so the mean stays ISL
        return _restricted(lambda k: rng.normal(cfg.isl, cfg.isl_std, k), 1, 2 * cfg.isl, n)
    return sample_production_lens(rng, n, cfg.production_mean)


def production_params(mean_of: str = "kept") -> tuple[float, float]:
    """(mu, sigma) of the production lognormal whose ``mean_of`` mean is PRODUCTION_MEAN_LEN."""
    if mean_of not in PRODUCTION_MEANS:
        raise ValueError(f"production_mean must be one of {PRODUCTION_MEANS}, got {mean_of!r}")
    return ((PRODUCTION_LOG_MU, PRODUCTION_LOG_SIGMA) if mean_of == "kept"
            else (PRODUCTION_RAW_LOG_MU, PRODUCTION_RAW_LOG_SIGMA))


def sample_production_lens(rng: np.random.Generator, n: int, mean_of: str = "kept") -> np.ndarray:
    """``n`` lengths from the fitted lognormal, rounded; outside [31, 32768] redrawn (left out)."""
    mu, sigma = production_params(mean_of)
    return _restricted(lambda k: rng.lognormal(mu, sigma, k), PRODUCTION_MIN_LEN, PRODUCTION_MAX_LEN, n)


def _restricted(draw, lo: int, hi: int, n: int) -> np.ndarray:
    """``n`` rounded values of ``draw(k)`` (k samples at a time), those outside [lo, hi] redrawn."""
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:
        x = np.rint(draw(max(2 * (n - len(out)), 64)))
        x = x[(x >= lo) & (x <= hi)].astype(np.int64)
        out = np.concatenate([out, x[:n - len(out)]])
    return out


def restricted_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[X | lo <= X <= hi] for ln X ~ Normal(mu, sigma) (closed form; hi may be math.inf)."""
    phi = NormalDist().cdf
    a, b = math.log(lo), math.log(hi)
    num = phi((b - mu - sigma ** 2) / sigma) - phi((a - mu - sigma ** 2) / sigma)
    den = phi((b - mu) / sigma) - phi((a - mu) / sigma)
    return math.exp(mu + sigma ** 2 / 2) * num / den


def fit_production_lognormal(mean_of: str = "kept") -> tuple[float, float]:
    """(mu, sigma) with (1) the raw PRODUCTION_TAIL_QUANTILE at PRODUCTION_TAIL_LEN and (2) the mean
    at PRODUCTION_MEAN_LEN: restricted to [PRODUCTION_MIN_LEN, PRODUCTION_MAX_LEN] (``kept``: the
    requests §5.1 keeps) or to [PRODUCTION_MIN_LEN, inf) (``raw``: the whole trace of §2.3).

    (1) fixes mu = ln(tail) - z·sigma; along that line the restricted mean falls monotonically
    with sigma (more mass moves below the tail anchor; for the raw mean while sigma < z), so (2)
    is one root, found by bisection.
    """
    production_params(mean_of)  # validates mean_of
    z = NormalDist().inv_cdf(PRODUCTION_TAIL_QUANTILE)
    top = math.log(PRODUCTION_TAIL_LEN)
    upper = PRODUCTION_MAX_LEN if mean_of == "kept" else math.inf

    def excess(sigma: float) -> float:
        return restricted_lognormal_mean(top - z * sigma, sigma, PRODUCTION_MIN_LEN, upper) - PRODUCTION_MEAN_LEN

    lo, hi = 0.3, (4.0 if mean_of == "kept" else z)  # excess(lo) > 0 > excess(hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    sigma = (lo + hi) / 2
    return top - z * sigma, sigma


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
