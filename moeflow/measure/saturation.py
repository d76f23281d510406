"""The saturation probe: the prompt tokens/s a deployment reaches when it is offered more than it
can serve, and the evidence that it was. Pure Python (the simulator's comparisons read its results).

A probe offers requests at rate r and measures ``prefill_tok_s`` (prompt tokens of completed
requests / start to last completion). Below capacity that is the offered load, not what the
deployment can do, so one probe at a fixed rate proves nothing: a rate that saturated one machine
is served with room to spare by a faster one. So the probe raises the offered rate:

    probe at ``start_rps``, then at ``rate_factor`` (2) times the previous rate (the same requests,
    arriving faster), until one raise grows the throughput by less than ``growth_tol`` (10%), or
    the deployment served requests at less than ``served_below`` (half) the offered rate: either
    way at that rate it served well under what it was offered, its queue grew, and its throughput
    is what it can do (the plateau; with few requests the queue's growth shows before the plateau,
    as batches keep getting fuller). That probe is the result, *saturated*.

After ``max_raises`` raises (the cap: ``start_rps`` x rate_factor**max_raises, 16x by default)
without such a plateau the result is "not saturated at <its highest rate> rps", and its
throughput is never called saturation throughput: reports print that phrase and compute no
saturation ratio or capacity share from it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SaturationSearch:
    start_rps: float  # the first offered rate (an experiment's saturation_rps)
    rate_factor: float = 2.0  # each raise multiplies the offered rate by this
    growth_tol: float = 0.1  # saturated once a raise grows throughput by less than this fraction
    max_raises: int = 4  # the cap: start_rps x rate_factor**max_raises
    served_below: float = 0.5  # ... or saturated once requests complete at under this share of the offered rate

    def __post_init__(self) -> None:
        if not self.start_rps > 0:
            raise ValueError(f"SaturationSearch: start_rps must be > 0, got {self.start_rps}")
        if not self.rate_factor > 1 + self.growth_tol:
            raise ValueError(f"SaturationSearch: rate_factor ({self.rate_factor}) must exceed 1 + growth_tol "
                             f"({self.growth_tol}): a raise must be able to show throughput growing")
        if self.growth_tol < 0 or self.max_raises < 1:
            raise ValueError("SaturationSearch: growth_tol must be >= 0 and max_raises >= 1")


@dataclass(frozen=True)
class SaturationResult:
    saturated: bool  # the last raise grew throughput by less than growth_tol
    point: dict  # the probe at the highest offered rate: the saturated one when saturated
    probes: tuple[tuple[float, float], ...]  # (offered rps, prompt tok/s) of every probe, in order

    @property
    def offered_rps(self) -> float:
        return self.point["rps"]

    def describe(self) -> str:
        tok = _tok_s(self.point)
        if self.saturated:
            return f"saturated at {self.offered_rps:g} rps: {tok:.0f} tok/s"
        return f"not saturated at {self.offered_rps:g} rps (served {tok:.0f} tok/s)"

    def to_point(self) -> dict:
        """The result point as a result file keeps it: the probe, whether it saturated, every probe."""
        return {**self.point, "saturated": self.saturated,
                "saturation_probes": [{"rps": r, "prefill_tok_s": t} for r, t in self.probes]}


def _tok_s(point: dict) -> float:
    return point.get("prefill_tok_s") or 0.0  # nothing completed: no throughput


def find_saturation(measure: Callable[[float], dict], search: SaturationSearch) -> SaturationResult:
    """``measure(rate)`` runs one probe at the offered ``rate`` and returns its point."""
    points = [measure(search.start_rps)]
    saturated = False
    for _ in range(search.max_raises):
        points.append(measure(points[-1]["rps"] * search.rate_factor))
        p = points[-1]
        served_rps = p["completed"] / p["duration_s"] if p.get("duration_s") and p.get("completed") else None
        plateau = _tok_s(p) < (1 + search.growth_tol) * _tok_s(points[-2])
        saturated = plateau or (served_rps is not None and served_rps < search.served_below * p["rps"])
        if saturated:
            break
    return SaturationResult(saturated, points[-1], tuple((p["rps"], _tok_s(p)) for p in points))
