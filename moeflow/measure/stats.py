"""Repeats and their uncertainty: means with Student-t confidence intervals, paired ratios, and
the "distinguishable from noise" verdict every comparison reports. Pure Python (the simulator and
the HTTP client share it).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30 (standard tables); above 30 the
# normal quantile is within 4% and shrinking
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
_Z975 = 1.959964


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"t975: need df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else _Z975


@dataclass(frozen=True)
class Interval:
    """A mean over repeats and its 95% confidence interval (t-distribution); n == 1: no interval."""

    mean: float
    lo: float
    hi: float
    n: int
    values: tuple[float, ...] = ()

    def overlaps(self, other: "Interval") -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def to_dict(self) -> dict:
        return {"mean": self.mean, "ci95": [self.lo, self.hi], "n": self.n, "values": list(self.values)}

    def fmt(self, scale: float = 1.0, digits: int = 3) -> str:
        if self.n < 2 or not math.isfinite(self.half_width):
            return f"{self.mean * scale:.{digits}g}"
        return f"{self.mean * scale:.{digits}g} ± {self.half_width * scale:.{max(1, digits - 1)}g}"


def mean_ci(values: list[float]) -> Interval | None:
    """Mean and 95% t-interval of the finite values (None when there are none)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    m = statistics.fmean(xs)
    if len(xs) == 1:
        return Interval(m, m, m, 1, tuple(xs))
    h = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(m, m - h, m + h, len(xs), tuple(xs))


def paired_ratio_ci(a: list[float | None], b: list[float | None]) -> Interval | None:
    """a/b per repeat (same seed, same slot of the rotation), then mean and 95% t-interval:
    pairing removes what the two systems' runs of one repeat share (workload draw, machine drift)."""
    ratios = [x / y for x, y in zip(a, b) if x is not None and y is not None and y != 0
              and math.isfinite(x) and math.isfinite(y)]
    return mean_ci(ratios)


# what every report says of its verdicts
VERDICT_RULE = ("verdicts are on the paired interval: distinguishable when the 95% interval of the paired ratio "
                "excludes 1")


def verdict(a: Interval | None, b: Interval | None, ratio: Interval | None) -> str:
    """"distinguishable" when the paired ratio's 95% interval excludes 1, else "not
    distinguishable"; "single run" without repeats. Pairing (same seed, same slot of the rotation)
    removes what the two systems' runs of one repeat share, the workload draw and the machine's
    drift, which is what widens each system's own interval: their overlap is not evidence of
    noise. Without a paired ratio of >= 2 repeats, the unpaired test: the two intervals disjoint."""
    if a is None or b is None:
        return "no data"
    if a.n < 2 or b.n < 2:
        return "single run"
    if ratio is not None and ratio.n >= 2:
        return "not distinguishable" if ratio.contains(1.0) else "distinguishable"
    return "not distinguishable" if a.overlaps(b) else "distinguishable"
