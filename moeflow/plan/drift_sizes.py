"""The arithmetic of ``moeflow plan``'s drifting question (``plan/drift.py``): what a deployment
needs at each moment of the trace, which fixed sizes are worth simulating, and a sized deployment's
estimated good requests per device-second. Pure Python on numbers: a unit's rates come from
``plan/estimate.py``'s sides at the trace's shortest and longest prompts.

A side's capacity at a moment is its units times a unit's SLO rate at that moment's prompt lengths;
what it cannot serve waits for the next moment (a fluid queue), and a moment's arrivals are good
while the backlog after it is within the side's slack (prefill: what it serves in the TTFT bound;
decode: none, a backlog there is a batch past its TPOT bound). An elastic deployment's units are
the need rounded up as its controller saw it one observation window earlier. What it leaves out
(joiners' start, the controller's band and hold, how a queue's requests spread over the bound) is
why the best estimates are simulated whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeflow.measure.drift import curve_at

MOMENTS = 60  # the trace is read at this many evenly spaced moments
QUANTILES = (1.0, 0.9, 0.75, 0.5)  # of the need over the trace's moments: the fixed sizes (1.0: the peak's)


@dataclass(frozen=True)
class Moment:
    t_s: float
    rps: float  # the arrival rate then
    length: float  # the prompts' length factor then


def moments(rps: float, rate_curve, length_curve, duration_s: float, n: int = MOMENTS) -> list[Moment]:
    """The trace at the middles of ``n`` equal spans of ``duration_s``."""
    ts = [(k + 0.5) * duration_s / n for k in range(n)]
    return [Moment(t, rps * (float(curve_at(rate_curve, t)) if rate_curve else 1.0),
                   float(curve_at(length_curve, t)) if length_curve else 1.0) for t in ts]


def length_range(length_curve, duration_s: float) -> tuple[float, float]:
    """The shortest and longest length factor over [0, duration_s] (the curve is linear between
    knots, so its extremes are at knots or the ends)."""
    if not length_curve:
        return 1.0, 1.0
    ts = [0.0, duration_s] + [t for t, _ in length_curve if t < duration_s]
    fs = [float(curve_at(length_curve, t)) for t in ts]
    return min(fs), max(fs)


def unit_rate(at_lo: tuple[float, float], at_hi: tuple[float, float], length: float) -> float:
    """A unit's SLO rate at prompts ``length`` x long, from (factor, rate) at two factors: a
    request's cost taken as affine in its prompt's length, so 1 / rate is affine in the factor."""
    (f0, r0), (f1, r1) = at_lo, at_hi
    if f1 == f0:
        return r0
    inv = 1 / r0 + (1 / r1 - 1 / r0) * (length - f0) / (f1 - f0)
    return 1 / inv if inv > 0 else math.inf


def needs(ms: list[Moment], at_lo: tuple[float, float], at_hi: tuple[float, float]) -> list[float]:
    """Units needed at each moment: its rate over a unit's rate at its prompt lengths."""
    return [m.rps / unit_rate(at_lo, at_hi, m.length) for m in ms]


def quantile_units(need: list[float], lo: int, hi: int) -> list[int]:
    """Per quantile of ``QUANTILES``: the units that serve every moment's need up to it (nearest
    rank), within [lo, hi]."""
    s = sorted(need)
    return [min(hi, max(lo, math.ceil(s[max(0, math.ceil(q * len(s)) - 1)] - 1e-9))) for q in QUANTILES]


def quantile_sizes(need: list[float], lo: int, hi: int) -> list[int]:
    """``quantile_units``, each once, smallest first."""
    return sorted(set(quantile_units(need, lo, hi)))


def following(need: list[float], lo: int, hi: int, lag: int = 0) -> list[int]:
    """An elastic deployment's units at each moment: the need ``lag`` moments earlier (what its
    controller had seen), rounded up, within [lo, hi]."""
    return [min(hi, max(lo, math.ceil(need[max(0, k - lag)] - 1e-9))) for k in range(len(need))]


def served(ms: list[Moment], capacity: list[float], slack_s: float, moment_s: float) -> list[bool]:
    """Whether each moment's arrivals are served within the SLO by a side of ``capacity`` (requests/s
    at each moment): a fluid queue carries what it could not serve to the next moment, and a
    moment's arrivals are good while the backlog after it is within ``slack_s`` of its capacity."""
    b, out = 0.0, []
    for m, mu in zip(ms, capacity):
        b = max(0.0, b + (m.rps - mu) * moment_s)
        out.append(b <= mu * slack_s + 1e-9)
    return out


def max_rise(need: list[float], span: int) -> int:
    """The most units the need (rounded up) rises by over ``span`` consecutive moments, at least 1:
    what one decision may have to add to keep up."""
    up = [math.ceil(x - 1e-9) for x in need]
    return max([1] + [up[k + span] - min(up[k:k + span + 1]) for k in range(len(up) - span)])


@dataclass(frozen=True)
class Estimate:
    good_per_device_s: float  # good requests per device-second
    within: float  # share of the arrivals served within the SLO
    mean_devices: float

    def to_dict(self) -> dict:
        return {"good_per_device_s": self.good_per_device_s, "within": self.within, "mean_devices": self.mean_devices}


def estimate(ms: list[Moment], devices: list[int], served: list[bool]) -> Estimate:
    """Good requests per device-second: the arrivals of the moments served, over the devices held
    at every moment (both per unit time: the moments span equal times)."""
    arrivals = sum(m.rps for m in ms)
    good = sum(m.rps for m, ok in zip(ms, served) if ok)
    held = sum(devices)
    return Estimate(good / held if held else 0.0, good / arrivals if arrivals else 0.0, held / len(ms))
