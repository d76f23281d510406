"""Workloads that change over time (issue: elastic deployments follow them): a curve of knots
[(t_s, factor), ...], linear between knots and flat beyond the ends, shapes the arrival rate
(``rate_curve``: the rate at t is rate_rps x factor) or the prompt lengths (``length_curve``: a
request arriving at t has its drawn length x factor). Pure Python + numpy.

Arrivals keep common random numbers: the gaps are drawn at rate_rps as before, in the curve's own
time tau, and each is mapped to the clock by the inverse of Lambda(t) = integral of the factor over
[0, t] (time rescaling of a renewal process), so a Poisson stream stays Poisson with the rate the curve
says, and the same seed gives the same requests in the same order under every curve.
"""
from __future__ import annotations

import numpy as np


def check_curve(curve, name: str) -> tuple[tuple[float, float], ...]:
    """``curve`` as sorted knots (t_s >= 0 increasing, factor > 0), or ValueError naming what is wrong."""
    knots = []
    for k in curve or ():
        if not (isinstance(k, (tuple, list)) and len(k) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in k)):
            raise ValueError(f"{name}: each knot is [t_s, factor], got {k!r}")
        knots.append((float(k[0]), float(k[1])))
    for (t0, _), (t1, _) in zip(knots, knots[1:]):
        if not t1 > t0:
            raise ValueError(f"{name}: knot times must increase, got {t0:g} then {t1:g}")
    if any(t < 0 or not f > 0 for t, f in knots):
        raise ValueError(f"{name}: need t_s >= 0 and factor > 0 in every knot, got {knots}")
    return tuple(knots)


def curve_at(curve, t) -> np.ndarray:
    """The factor at time(s) ``t``."""
    ts, fs = zip(*curve)
    return np.interp(t, ts, fs)


def _grid(curve, end_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Times (every knot, 0 and ``end_s``) and Lambda there: exact, the factor is linear between."""
    ts = np.unique(np.array([0.0, end_s] + [t for t, _ in curve if t < end_s]))
    fs = curve_at(curve, ts)
    lam = np.concatenate([[0.0], np.cumsum((fs[1:] + fs[:-1]) / 2 * np.diff(ts))])
    return ts, lam


def curve_integral(curve, end_s: float) -> float:
    """Lambda(end_s): the curve's own time elapsed by ``end_s`` on the clock."""
    return float(_grid(curve, end_s)[1][-1])


def warp_arrivals(taus: np.ndarray, curve, end_s: float) -> np.ndarray:
    """Arrival times drawn in the curve's own time, on the clock: Lambda^-1(tau) (piecewise
    quadratic, solved exactly per segment)."""
    ts, lam = _grid(curve, end_s)
    fs = curve_at(curve, ts)
    seg = np.clip(np.searchsorted(lam, taus, side="right") - 1, 0, len(ts) - 2)
    t0, f0, d = ts[seg], fs[seg], taus - lam[seg]
    slope = (fs[seg + 1] - f0) / (ts[seg + 1] - t0)
    # f0 x + slope x^2 / 2 = d for x in [0, segment]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(np.abs(slope) < 1e-12, d / f0, (-f0 + np.sqrt(np.maximum(f0 * f0 + 2 * slope * d, 0))) / slope)
    return t0 + x
