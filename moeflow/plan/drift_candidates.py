"""The deployments ``moeflow plan`` weighs on a drifting trace (``plan/drift.py``): every layout of
the stationary search is a family; a family is sized in units (dep and dwdp: ranks; asap and afd:
copies of their smallest ratio; pd: prefill and decode instances, each side sized alone) at the
quantiles of what the trace needs (``plan/drift_sizes.py``), within the device budget; beside the
fixed sizes, one elastic deployment per family the controller resizes (``--autoscale``: dep's ranks,
afd's A:F with topology all, pd's xPyD), starting at what the trace's first moment needs and free
to grow to the budget. Each gets its estimate; ``drift.py`` simulates the best whole.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from moeflow.autoscale_config import DEFAULT_SAMPLE_S, AutoscalePolicy
from moeflow.plan.candidates import Candidate, aggregated_name, side_devices
from moeflow.plan.drift_sizes import (Estimate, Moment, estimate, following, max_rise, needs, quantile_sizes,
                                      served, unit_rate)

# the counts a layout is made of, scaled together (their gcd is the family's units at N devices)
_COUNTS = {"dep": ("dp",), "dwdp": ("dp",), "asap": ("attn_dp", "moe_workers"), "afd": ("attn_workers", "ffn_workers")}
_LEAST = {"dwdp": 2}  # units below which a mode is not itself (dwdp pulls experts from peers)


@dataclass(frozen=True)
class DriftCandidate:
    name: str
    family: str
    system: dict  # a simulate config's system entry; an elastic one with its ``autoscale:`` policy
    elastic: bool
    devices: int  # fixed: its devices; elastic: the most it may hold
    estimate: Estimate


@dataclass(frozen=True)
class Policy:
    """What every elastic candidate's controller keeps (the question's SLO) and how often it may act."""

    tpot_s: float
    ttft_s: float
    moment_s: float = 5.0  # the span of one of the trace's moments
    interval_s: float = AutoscalePolicy.interval_s  # the policies' default least time between changes
    seen_s: float = AutoscalePolicy.window * DEFAULT_SAMPLE_S  # what a decision averages, by default

    def step(self, need: list[float]) -> int:
        """What one decision may have to add: the most the need rises within one interval."""
        return max_rise(need, max(1, math.ceil(self.interval_s / self.moment_s)))

    @property
    def lag(self) -> int:
        """Moments the controller is behind the load (it decides on what it averaged)."""
        return math.ceil(self.seen_s / self.moment_s - 1e-9)

    def good(self, ms: list[Moment], units: list[int], at: tuple, slack_s: float) -> list[bool]:
        """Each moment's arrivals served within the SLO by ``units`` of a side whose unit serves
        ``at`` = ((factor, rps), (factor, rps)) (``drift_sizes.served``)."""
        return served(ms, [u * unit_rate(*at, m.length) for u, m in zip(units, ms)], slack_s, self.moment_s)


def _units(system: dict) -> int:
    return math.gcd(*(system[k] for k in _COUNTS[system["mode"]]))


def _scaled(system: dict, k: int) -> dict:
    g = _units(system)
    return {**system, **{key: system[key] // g * k for key in _COUNTS[system["mode"]]}}


def _family(system: dict) -> str:
    """dep and dwdp by their mode (and TP), asap and afd by their smallest ratio."""
    if system["mode"] in ("dep", "dwdp"):
        return system["mode"] + (f"_tp{system['tp']}" if system.get("tp", 1) > 1 else "")
    return aggregated_name(_scaled(system, 1))


def _tag(c: Candidate) -> str:
    return "@" + c.name.partition("@")[2] if "@" in c.name else ""


def aggregated(c: Candidate, at_lo: tuple[float, float], at_hi: tuple[float, float], ms: list[Moment],
               budget: int, fits: Callable[[Candidate], Candidate], policy: Policy) -> list[DriftCandidate]:
    """A family of aggregated layouts: ``c`` (N devices, its estimate at two length factors: the
    family's rates, divided per unit) at each size, and elastic where the controller resizes it."""
    g = _units(c.system)
    per_unit = ((at_lo[0], at_lo[1] / g), (at_hi[0], at_hi[1] / g))
    need = needs(ms, *per_unit)
    unit_devices = c.devices // g
    most = budget // unit_devices
    sized = {k: fits(Candidate(c.name, _scaled(c.system, k), unit_devices * k, "aggregated"))
             for k in range(_LEAST.get(c.system["mode"], 1), most + 1)}
    ok = [k for k, s in sized.items() if s.feasible]
    if not ok:
        return []
    floor = ok[0]  # the fewest units that hold the weights and one whole request (dep: its memory floor)
    fam = _family(c.system) + _tag(c)
    out = []
    for k in quantile_sizes(need, floor, most):
        if sized[k].feasible:
            good = policy.good(ms, [k] * len(ms), per_unit, policy.ttft_s)
            out.append(DriftCandidate(aggregated_name(sized[k].system) + _tag(c), fam, sized[k].system, False, sized[k].devices,
                                      estimate(ms, [sized[k].devices] * len(ms), good)))
    elastic = _elastic(c, sized, floor, most, need, unit_devices, ms, policy, per_unit, fits)
    return out + ([DriftCandidate("elastic:" + fam, fam, *elastic)] if elastic else [])


def _elastic(c: Candidate, sized: dict, floor: int, most: int, need: list[float], unit_devices: int,
             ms: list[Moment], policy: Policy, per_unit: tuple, fits: Callable[[Candidate], Candidate]):
    mode, lay = c.system["mode"], c.system
    units = following(need, floor, most, policy.lag)
    start = units[0]
    if not sized[start].feasible:
        return None
    est = estimate(ms, [u * unit_devices for u in units], policy.good(ms, units, per_unit, policy.ttft_s))
    slo = {"tpot_slo_s": policy.tpot_s, "ttft_slo_s": policy.ttft_s}
    if mode == "dep" and lay.get("tp", 1) == 1:
        system = {**sized[start].system, "max_dp": most,
                  "autoscale": {**slo, "min_ranks": floor, "max_ranks": most, "max_step": policy.step(need)}}
    elif mode == "afd":
        # the controller sets A:F itself: from the family's ratio at the start, anywhere within the budget
        budget = most * unit_devices
        a = sized[start].system["attn_workers"]
        step = policy.step([x * lay["attn_workers"] / _units(lay) for x in need])
        # the fewest daemons whose experts fit (an instance's memory does not depend on how many there are)
        least_ffn = next((f for f in range(1, budget - a + 1) if fits(Candidate(
            c.name, {**sized[start].system, "ffn_workers": f}, a + f, "aggregated")).feasible), None)
        if least_ffn is None:
            return None
        system = {**sized[start].system, "topology": "all",
                  "autoscale": {**slo, "min_attention": 1, "max_attention": budget - 1, "min_ffn": least_ffn,
                                "max_ffn": budget - 1, "max_processes": budget, "max_step": min(step, budget - a)}}
    else:  # dwdp's ranks and asap's workers: the engine's controller or none, not the simulator's
        return None
    return system, True, most * unit_devices, est


def pd(c: Candidate, prefill: tuple[tuple[float, float], tuple[float, float]],
       decode: tuple[tuple[float, float], tuple[float, float]], ms: list[Moment], budget: int,
       policy: Policy) -> list[DriftCandidate]:
    """A pd pair's family: X prefill and Y decode instances, each side sized by its own need (its
    instance's rate at each moment's prompt lengths), within ``budget`` devices; and elastic."""
    p, d = side_devices(c.system["prefill"]), side_devices(c.system["decode"])
    if p + d > budget:
        return []
    need_p, need_d = needs(ms, *prefill), needs(ms, *decode)

    def good(xs: list[int], ys: list[int]) -> list[bool]:  # prompts may wait up to the TTFT bound, decode not
        return [a and b for a, b in zip(policy.good(ms, xs, prefill, policy.ttft_s), policy.good(ms, ys, decode, 0.0))]
    out, n = [], len(ms)
    for xp in quantile_sizes(need_p, 1, budget // p):
        for xd in quantile_sizes(need_d, 1, budget // d):
            if xp * p + xd * d <= budget:
                out.append(DriftCandidate(f"pd_{xp}p{xd}d_{c.name[3:]}", c.name,
                                          {**c.system, "prefill_instances": xp, "decode_instances": xd}, False,
                                          xp * p + xd * d, estimate(ms, [xp * p + xd * d] * n, good([xp] * n, [xd] * n))))
    lo_p, lo_d = min(following(need_p, 1, budget)), min(following(need_d, 1, budget))
    hi_p, hi_d = max(lo_p, (budget - lo_d * d) // p), max(lo_d, (budget - lo_p * p) // d)
    xs, ys = following(need_p, lo_p, hi_p, policy.lag), following(need_d, lo_d, hi_d, policy.lag)
    held = [x * p + y * d for x, y in zip(xs, ys)]
    while any(h > budget for h in held):  # both sides at their most: the budget's share in proportion
        k = held.index(max(held))
        xs[k], ys[k] = (xs[k] - 1, ys[k]) if xs[k] * p >= ys[k] * d and xs[k] > lo_p else (xs[k], ys[k] - 1)
        held[k] = xs[k] * p + ys[k] * d
    system = {**c.system, "prefill_instances": xs[0], "decode_instances": ys[0],
              "autoscale": {"tpot_slo_s": policy.tpot_s, "ttft_slo_s": policy.ttft_s, "min_prefill": lo_p,
                            "max_prefill": hi_p, "min_decode": lo_d, "max_decode": hi_d, "max_processes": budget,
                            "max_step": policy.step(need_p)}}
    return out + [DriftCandidate(f"elastic:{c.name}", c.name, system, True, budget, estimate(ms, held, good(xs, ys)))]
