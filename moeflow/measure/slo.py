"""SLO throughput: the highest request rate that stays within a TTFT SLO, by bisection.

What "within the SLO" means is a ``SloMetric``: ``mean`` (mean TTFT <= SLO, the default and what
these results used before the metric was explicit), ``p50``/``p90``/``p99`` or ``attainment:F``.
A quantile metric counts every request of the run, completed or not (one that never got a first
token has an infinite TTFT), and takes the nearest rank: p90 <= SLO exactly when at least 90% of
the requests had TTFT <= SLO, which is vLLM's goodput notion; so ``p90`` and ``attainment:0.9``
decide alike.

Each probe is a full replay at one rate, so probes are few and expensive; the search reuses the
rates already measured by the sweep to bracket the threshold before probing anything.

1. Bracket. lo = the highest measured rate that meets the SLO below the lowest one that misses
   it; hi = the lowest measured rate above lo that misses it. With no passing rate, halve below
   the lowest rate until one passes (at most ``max_halvings`` probes); with no failing rate,
   double above the highest until one fails (at most ``max_doublings`` probes: the cap).
2. Bisect. Probe the midpoint of [lo, hi]; it becomes lo if it meets the SLO, else hi. Stop after
   ``max_probes`` probes or once hi / lo <= 1 + rel_tol.
3. Answer lo: the highest rate *measured* to meet the SLO with a failing rate above it.

A rate that meets the SLO with no failing rate above it is only a lower bound: it is never the
answer. Reaching the cap (or a sweep whose every rate meets it) gives ``rps = None`` and
``at_least_rps`` = the highest rate that met it; results write it as ``"slo_rps": null,
"slo_rps_at_least": X`` and tables print ``>= X``.

NOTE: measured TTFT is noisy and not strictly monotone in the rate; bisection assumes it is, so
the answer is only as sharp as the run-to-run noise at the threshold.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from moeflow.measure.metrics import mean_ttft_lower_bound

METRICS = ("mean", "p50", "p90", "p99", "attainment:F")


@dataclass(frozen=True)
class SloMetric:
    name: str  # as given: "mean", "p90", "attainment:0.95"
    quantile: float | None  # None: the mean; q: the nearest-rank q-quantile over all requests

    @classmethod
    def parse(cls, text: str) -> "SloMetric":
        if text == "mean":
            return cls("mean", None)
        if text in ("p50", "p90", "p99"):
            return cls(text, int(text[1:]) / 100)
        if text.startswith("attainment:"):
            try:
                q = float(text.split(":", 1)[1])
            except ValueError:
                q = math.nan
            if 0 < q <= 1:
                return cls(text, q)
        raise ValueError(f"SLO metric must be one of {METRICS} (F in (0, 1]), got {text!r}")

    def score(self, point: dict) -> float:
        """The run's TTFT under this metric (inf when it cannot be met); the run meets an SLO of
        s seconds exactly when score <= s."""
        if self.quantile is None:
            return point["ttft_mean_s"] if point["ttft_mean_s"] is not None else math.inf
        ttfts = point.get("ttfts_s")
        if ttfts is None:  # a point without per-request TTFTs (a result's summary, older files): not decidable
            return math.nan
        n = point.get("num_requests", len(ttfts))
        k = math.ceil(self.quantile * n)
        return ttfts[k - 1] if 0 < k <= len(ttfts) else (0.0 if k == 0 else math.inf)

    def certainly_fails(self, ttft_done_s: list[float], waiting_since_s: list[float], num_total: int,
                        now_s: float, slo_s: float) -> bool:
        """Whether a run still in progress has already missed the SLO whatever happens next."""
        if self.quantile is None:
            return mean_ttft_lower_bound(ttft_done_s, waiting_since_s, num_total, now_s) > slo_s
        misses = sum(t > slo_s for t in ttft_done_s) + sum(now_s - a > slo_s for a in waiting_since_s)
        return misses > num_total - math.ceil(self.quantile * num_total)


MEAN = SloMetric("mean", None)


@dataclass(frozen=True)
class TpotBound:
    """A TPOT bound on the statistic a score reads: ``quantile`` q as ``np.percentile`` takes it
    (linear between ranks, over the completed requests with two or more output tokens), or None:
    their mean."""

    slo_s: float
    quantile: float | None

    def certainly_fails(self, lower_s: list[float], num_total: int) -> bool:
        """``lower_s``: a lower bound of each such request's TPOT, for requests certain to complete
        (a finished one's own; one still decoding: its time since its first token over its output
        tokens after the first). Whatever count C <= ``num_total`` completes, the quantile is at least
        the sorted TPOTs' value at floor(q(C-1)), which exceeds the bound once C - floor(q(C-1))
        of them do; that count only grows with C, so C = num_total is the case to beat. The mean
        over C is at least the bounds' sum over ``num_total``."""
        if not num_total or not lower_s:
            return False
        if self.quantile is None:
            return sum(lower_s) / num_total > self.slo_s
        misses = sum(t > self.slo_s for t in lower_s)
        return misses >= num_total - math.floor(self.quantile * (num_total - 1))


@dataclass(frozen=True)
class StopRule:
    """Stop a probe as soon as it has certainly missed the SLO: an overloaded probe would
    otherwise take as long to drain its queue as it took to fill it. With ``tpot``, a probe whose
    TPOT certainly misses its bound stops too (a decode-bound probe otherwise runs to its end)."""

    metric: SloMetric
    slo_s: float
    tpot: TpotBound | None = None

    def fails(self, ttft_done_s: list[float], waiting_since_s: list[float], num_total: int, now_s: float,
              tpot_lower_s: list[float] | None = None) -> bool:
        if self.metric.certainly_fails(ttft_done_s, waiting_since_s, num_total, now_s, self.slo_s):
            return True
        return self.tpot is not None and tpot_lower_s is not None and self.tpot.certainly_fails(tpot_lower_s, num_total)
ALL_METRICS = tuple(SloMetric.parse(m) for m in ("mean", "p50", "p90", "p99")) + (SloMetric.parse("attainment:0.95"),)


@dataclass(frozen=True)
class SloSearch:
    slo_ttft_s: float
    max_probes: int = 5  # bisection probes after the bracket is found
    rel_tol: float = 0.05  # stop once hi / lo <= 1 + rel_tol
    max_halvings: int = 4  # probes below the lowest rate while none meets the SLO
    # probes above the highest rate while every one meets it (the cap: that rate x 2**max_doublings); a
    # probe far above the SLO rate stops early, so the doublings that matter are the passing ones
    max_doublings: int = 10
    metric: SloMetric = MEAN

    def __post_init__(self) -> None:
        if not self.slo_ttft_s > 0:
            raise ValueError(f"SloSearch: slo_ttft_s must be > 0, got {self.slo_ttft_s}")
        if min(self.max_probes, self.max_halvings, self.max_doublings) < 0:
            raise ValueError("SloSearch: max_probes, max_halvings and max_doublings must be >= 0")
        if not self.rel_tol > 0:
            raise ValueError(f"SloSearch: rel_tol must be > 0, got {self.rel_tol}")


@dataclass(frozen=True)
class SloResult:
    rps: float | None  # highest rate measured to meet the SLO below upper_rps; None: not bracketed
    upper_rps: float | None  # lowest rate above it measured to miss it; None: none did
    num_probes: int  # replays the search ran (the sweep's rates not counted)
    # no rate up to the cap missed the SLO: the SLO throughput is at least this (rps is None)
    at_least_rps: float | None = None

    def __post_init__(self) -> None:
        if self.rps is not None and self.upper_rps is None:
            raise ValueError(f"SloResult: {self.rps} rps is not bracketed (no failing rate above it): "
                             "give it as at_least_rps")
        if self.at_least_rps is not None and (self.rps is not None or self.upper_rps is not None):
            raise ValueError("SloResult: at_least_rps is for a search that found no failing rate")

    def describe(self) -> str:
        """The result in words, as ``bench serve`` prints it."""
        if self.at_least_rps is not None:
            return f">= {self.at_least_rps:g} rps (no failing rate found up to the search's cap)"
        if self.rps is None:
            return "none of the probed rates meets it" + (f" (misses at {self.upper_rps:g} rps)"
                                                         if self.upper_rps is not None else "")
        return f"{self.rps:g} rps (misses at {self.upper_rps:g} rps)"


def _bracketed(lo: float | None, hi: float | None, num_probes: int) -> SloResult:
    """lo with no failing rate above it is a lower bound only."""
    return SloResult(None, None, num_probes, lo) if hi is None and lo is not None else SloResult(lo, hi, num_probes)


def format_slo(rps: float | None, at_least_rps: float | None = None, fmt: str = "g") -> str:
    """An SLO throughput (or a bound on it) for a table: ``X``, ``>= X`` or ``-``."""
    if rps is not None:
        return f"{rps:{fmt}}"
    return f">= {at_least_rps:{fmt}}" if at_least_rps is not None else "-"


def as_bounded(result: dict | None) -> dict | None:
    """An ``SloResult`` dict as this module writes it; one written before bounds were kept apart
    (a rate with no failing rate above it given as ``rps``) is read as the bound it was."""
    if result and result.get("rps") is not None and result.get("upper_rps") is None:
        return {**result, "rps": None, "at_least_rps": result["rps"]}
    return result


def slo_over_repeats(results: list[dict | None]) -> dict:
    """Median and range of per-repeat SLO throughputs (``SloResult`` dicts; None: not measured).

    A repeat no rate met is left out, as is one not measured. An unbracketed repeat bounds its
    value from below only: each statistic is computed once with the bounds and once with +inf in
    their place; where the two agree it is known (``median``, ``min``, ``max``), else only the
    first is, as ``*_at_least`` (and the value is None)."""
    rps = [r.get("rps") if r else None for r in results]
    bounds = [r.get("at_least_rps") if r else None for r in results]
    low = [v if v is not None else b for v, b in zip(rps, bounds) if v is not None or b is not None]
    high = [v if v is not None else math.inf for v, b in zip(rps, bounds) if v is not None or b is not None]
    out = {"values": rps, "at_least_values": bounds}
    for name, stat in (("median", statistics.median), ("min", min), ("max", max)):
        lo, hi = (stat(xs) if xs else None for xs in (low, high))
        out[name], out[name + "_at_least"] = (lo, None) if lo == hi else (None, lo)
    return out


def probe_ttft_s(point: dict, metric: SloMetric = MEAN) -> float:
    """A ``bench serve`` point's score for the search (``SloMetric.score``; the mean TTFT by default)."""
    return metric.score(point)


def slo_rps_from_points(points: list[dict], metric: SloMetric, slo_s: float) -> SloResult:
    """The SLO throughput the measured points show under ``metric``: the highest rate that meets
    the SLO below the lowest rate that misses it (no probing). Points the metric cannot decide
    (a stopped-early probe for a quantile metric it did not stop on) are left out."""
    # a probe stopped early decides only the metric that stopped it (it failed that one)
    scores = {p["rps"]: metric.score(p) for p in points
              if not p.get("stopped_early") or p.get("stopped_by", "mean") == metric.name}
    scores = {r: s for r, s in scores.items() if not math.isnan(s)}
    fails = [r for r, s in scores.items() if not s <= slo_s]
    first_fail = min(fails, default=math.inf)
    lo = max((r for r, s in scores.items() if s <= slo_s and r < first_fail), default=None)
    hi = min((r for r in fails if lo is None or r > lo), default=None)
    return _bracketed(lo, hi, 0)


def find_slo_rps(probe: Callable[[float], float], search: SloSearch, measured: dict[float, float]) -> SloResult:
    """``probe(rate)`` runs one replay and returns its score under the search's metric (the mean
    TTFT by default; inf when nothing completed); ``measured`` holds the sweep's rate -> score.
    Every probe is added to ``measured``."""
    if not measured:
        raise ValueError("find_slo_rps needs at least one measured rate to start from")
    slo = search.slo_ttft_s
    num_probes = 0

    def run(rate: float) -> bool:
        nonlocal num_probes
        num_probes += 1
        measured[rate] = probe(rate)
        return measured[rate] <= slo

    def bracket() -> tuple[float | None, float | None]:
        fails = [r for r, t in measured.items() if not t <= slo]
        first_fail = min(fails, default=float("inf"))
        lo = max((r for r, t in measured.items() if t <= slo and r < first_fail), default=None)
        hi = min((r for r in fails if lo is None or r > lo), default=None)
        return lo, hi

    lo, hi = bracket()
    for _ in range(search.max_halvings):
        if lo is not None:
            break
        run(min(measured) / 2)
        lo, hi = bracket()
    for _ in range(search.max_doublings):
        if lo is None or hi is not None:
            break
        run(max(measured) * 2)
        lo, hi = bracket()
    if lo is None or hi is None:
        return _bracketed(lo, hi, num_probes)
    for _ in range(search.max_probes):
        if hi / lo <= 1 + search.rel_tol:
            break
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return SloResult(lo, hi, num_probes)
