"""Rate matching of a disaggregated deployment: how many prefill and decode instances, given what
one instance of each side sustains on its own.

A decode instance completes ``decode.rps`` requests per second at its operating point (its batch at
the TPOT it is held to); a prefill instance takes ``prefill.rps`` at most, of which it may run at
``max_utilization`` (so that its queue, and TTFT, stay bounded). X prefill and Y decode instances
serve min(X·C·u, Y·R) requests per second: the slower side sets the rate (a decode side that is
fed less runs a smaller batch, at a better TPOT). The best split has the most requests per second
per device, and of those the smallest. For each Y the rate per device rises with X while the prefill side is the slower and
falls after, so the best X is one of the two integers around the balance Y·R / (C·u) (or the most
that fit): ``rate_match`` is one pass over Y. ``brute_force`` tries every (X, Y) and is its oracle.

The Pareto front of a sweep of operating points (TPS/user against output TPS/device) and the
ratio of two fronts over a band of TPS/user are here too: DWDP §5.3 reads its result that way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Side:
    """One instance of one side: its devices and the requests per second it sustains."""
    name: str
    devices: int
    rps: float

    def __post_init__(self) -> None:
        if self.devices < 1 or not self.rps > 0:
            raise ValueError(f"side {self.name!r}: devices >= 1 and rps > 0 (got {self.devices}, {self.rps})")


@dataclass(frozen=True)
class Split:
    prefill_instances: int
    decode_instances: int
    devices: int
    rps: float  # requests per second served: min(X·C·u, Y·R)
    prefill_utilization: float  # the served rate / (X·C)
    used: int  # what the rate is per: the devices, or the cores their processes share

    @property
    def rps_per_device(self) -> float:
        return self.rps / self.used


def _split(p: Side, d: Side, x: int, y: int, u: float, cores: int | None = None) -> Split:
    n = x * p.devices + y * d.devices
    kp = kd = 1.0
    if cores:  # each side was measured alone; together their processes share the cores
        share = min(1.0, cores / n)
        kp, kd = share / min(1.0, cores / p.devices), share / min(1.0, cores / d.devices)
    rps = min(x * p.rps * u * kp, y * d.rps * kd)
    return Split(x, y, n, rps, rps / (x * p.rps * kp), min(n, cores) if cores else n)


def _key(s: Split) -> tuple:
    # most requests per device (to 9 digits: scaled copies of one split tie); then the smaller
    # deployment (copies of it serve the same per device on the rest)
    return (-round(s.rps_per_device, 9), s.devices, s.prefill_instances)


def rate_match(prefill: Side, decode: Side, max_devices: int, max_utilization: float = 1.0,
               decode_bound: bool = False, cores: int | None = None) -> Split | None:
    """The best split of at most ``max_devices`` devices (None: not even one of each fits).
    ``decode_bound``: only splits whose prefill side keeps up (the decode side at its operating
    point, as a Pareto sweep of decode batches needs). ``cores``: the devices are processes sharing
    this many cores (a CPU host): each side's rate shrinks with its share of them, and the rate
    per device is per core used; then every split is tried."""
    if not 0 < max_utilization <= 1:
        raise ValueError(f"max_utilization must be in (0, 1], got {max_utilization}")
    if cores:
        return brute_force(prefill, decode, max_devices, max_utilization, decode_bound, cores)
    best = None
    for y in range(1, (max_devices - prefill.devices) // decode.devices + 1):
        most = (max_devices - y * decode.devices) // prefill.devices
        balance = y * decode.rps / (prefill.rps * max_utilization)
        up = max(1, math.ceil(balance * (1 - 1e-12)))
        for x in {up} if decode_bound else {min(most, max(1, math.floor(balance))), min(most, up)}:
            if x > most:
                continue
            s = _split(prefill, decode, x, y, max_utilization)
            if best is None or _key(s) < _key(best):
                best = s
    return best


def brute_force(prefill: Side, decode: Side, max_devices: int, max_utilization: float = 1.0,
                decode_bound: bool = False, cores: int | None = None) -> Split | None:
    """``rate_match``'s oracle: every (X, Y) that fits (and keeps up, with ``decode_bound``)."""
    splits = [_split(prefill, decode, x, y, max_utilization, cores)
              for x in range(1, max_devices // prefill.devices + 1)
              for y in range(1, max_devices // decode.devices + 1)
              if x * prefill.devices + y * decode.devices <= max_devices]
    return min((s for s in splits if not decode_bound or s.rps >= s.decode_instances * decode.rps * _share(s, decode, cores)
                * (1 - 1e-12)), key=_key, default=None)


def _share(s: Split, side: Side, cores: int | None) -> float:
    return min(1.0, cores / s.devices) / min(1.0, cores / side.devices) if cores else 1.0


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (x, y) points no other point beats in both (higher is better in both), by ascending x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front[::-1]


def front_at(front: list[tuple[float, float]], x: float) -> float | None:
    """The front's y at x, linear between its points (as a Pareto plot joins them); below its first
    x, its first point's y (that deployment also serves slower users); None past its last x."""
    if not front or x > front[-1][0]:
        return None
    if x <= front[0][0]:
        return front[0][1]
    for (x0, y0), (x1, y1) in zip(front, front[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def front_ratio(a: list[tuple[float, float]], b: list[tuple[float, float]], lo: float, hi: float,
                num: int = 41) -> dict:
    """a's y over b's at equal x, over ``num`` evenly spaced x in [lo, hi] both fronts reach: the mean,
    the smallest and the largest ratio, and where they were read (first x, last x, count)."""
    xs = [lo + (hi - lo) * k / (num - 1) for k in range(num)]
    ratios = [(x, ya / yb) for x in xs if (ya := front_at(a, x)) and (yb := front_at(b, x))]
    if not ratios:
        return {"mean": None, "min": None, "max": None, "read_at": None}
    rs = [r for _, r in ratios]
    return {"mean": sum(rs) / len(rs), "min": min(rs), "max": max(rs),
            "read_at": [ratios[0][0], ratios[-1][0], len(ratios)]}
