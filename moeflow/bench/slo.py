"""SLO throughput: the highest request rate whose mean TTFT stays within the SLO, by bisection.

Each probe is a full replay at one rate, so probes are few and expensive; the search reuses the
rates already measured by the sweep to bracket the threshold before probing anything.

1. Bracket. lo = the highest measured rate that meets the SLO below the lowest one that misses
   it; hi = the lowest measured rate above lo that misses it. With no passing rate, halve below
   the lowest rate until one passes; with no failing rate, double above the highest until one
   fails (at most ``max_expand`` probes each way).
2. Bisect. Probe the midpoint of [lo, hi]; it becomes lo if it meets the SLO, else hi. Stop after
   ``max_probes`` probes or once hi / lo <= 1 + rel_tol.
3. Answer lo: the highest rate *measured* to meet the SLO with a failing rate above it.

NOTE: measured TTFT is noisy and not strictly monotone in the rate; bisection assumes it is, so
the answer is only as sharp as the run-to-run noise at the threshold.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SloSearch:
    slo_ttft_s: float
    max_probes: int = 5  # bisection probes after the bracket is found
    rel_tol: float = 0.05  # stop once hi / lo <= 1 + rel_tol
    max_expand: int = 4  # probes spent looking for a bracket on either side

    def __post_init__(self) -> None:
        if not self.slo_ttft_s > 0:
            raise ValueError(f"SloSearch: slo_ttft_s must be > 0, got {self.slo_ttft_s}")
        if self.max_probes < 0 or self.max_expand < 0:
            raise ValueError("SloSearch: max_probes and max_expand must be >= 0")
        if not self.rel_tol > 0:
            raise ValueError(f"SloSearch: rel_tol must be > 0, got {self.rel_tol}")


@dataclass(frozen=True)
class SloResult:
    rps: float | None  # highest rate measured to meet the SLO; None: none did
    upper_rps: float | None  # lowest rate above it measured to miss it; None: none did
    num_probes: int  # replays the search ran (the sweep's rates not counted)


def probe_ttft_s(point: dict) -> float:
    """A ``bench serve`` point's mean TTFT for the search: inf when nothing completed."""
    return point["ttft_mean_s"] if point["ttft_mean_s"] is not None else math.inf


def find_slo_rps(probe: Callable[[float], float], search: SloSearch, measured: dict[float, float]) -> SloResult:
    """``probe(rate)`` runs one replay and returns its mean TTFT (inf when nothing completed);
    ``measured`` holds the sweep's rate -> mean TTFT. Every probe is added to ``measured``."""
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
    for _ in range(search.max_expand):
        if lo is None:
            run(min(measured) / 2)
        elif hi is None:
            run(max(measured) * 2)
        else:
            break
        lo, hi = bracket()
    if lo is None or hi is None:
        return SloResult(lo, hi, num_probes)
    for _ in range(search.max_probes):
        if hi / lo <= 1 + search.rel_tol:
            break
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return SloResult(lo, hi, num_probes)
