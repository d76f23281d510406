"""Every candidate's estimate from its sides, each simulated once on its own:

- A layout's prefill capacity C: the SLO search of ``search.evaluate`` on the workload's prompts
  alone (one output token), held to the TTFT bound only: the highest rate whose TTFT quantile is
  within it.
- A layout's decode capacity R (every mode): decode from handed-over KV (``sim/decode.py``,
  ``simulate_handed_decode``: the requests land with their prompt's KV, as on pd's decode side) at
  the batch's mean context (mean prompt + half the output) for batches of 1, 2, 4, ... per attention
  group up to what its KV holds; the largest mean batch B whose quantile batch (Poisson
  about B) decodes within the TPOT bound gives R = B / (output_len · TPOT(B)).

A pd pair (prefill layout, decode layout) gets the split of instances that serves the most requests
per second per device by rate matching (``sim/rate_match.py``). An aggregated deployment serves
prefill and decode on the same devices, so its estimate is C·R / (C + R) (the time each request
takes of each, added). Neither estimate includes what the sides do to each other (the handoff and
the queue between them; prefill stalling decode steps): ``search`` simulates the best candidates whole.
"""
from __future__ import annotations

from moeflow.experiment.serve import parse_experiment
from moeflow.plan.candidates import Candidate
from moeflow.sim.decode import simulate_handed_decode
from moeflow.sim.e2e import mean_prompt
from moeflow.sim.memory import GIB
from moeflow.sim.rate_match import Side, rate_match
from moeflow.sim.run import build_cost

_BATCHES = tuple(2 ** k for k in range(11))  # 1 ... 1024 per attention group


def side_key(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(layout.items()))


def prefill_only(base: dict) -> dict:
    """The experiment of a prefill layout's capacity: the same prompts, one output token, no TPOT bound."""
    w = {k: v for k, v in base["workload"].items() if k != "output_len_max"}
    return {**{k: v for k, v in base.items() if k != "slo_tpot_s"}, "workload": {**w, "output_len": 1}}


def prefill_side(searched: dict, devices: int) -> dict:
    """A prefill layout's capacity from its SLO search (``search.evaluate`` on ``prefill_only``)."""
    rps = searched.get("slo_rps") or searched.get("slo_rps_at_least")
    return {"rps": rps, "devices": devices, "bounded": searched.get("slo_rps") is not None,
            "busy": searched.get("busy"), "reason": searched.get("reason")}


def decode_capacity(layout: dict, devices: int, base: dict, slo, memory_gib: float, hbm_bytes: float) -> dict:
    w = base["workload"]
    osl = w["output_len"]
    context = int(_mean_prompt(w) + osl / 2)
    system = {**layout, "engine": {"memory_budget_gib": memory_gib, "kv_block_size": 16, "max_num_seqs": 1024}}
    cfg = parse_experiment({**base, "rps": [1.0], "systems": {"decode": system}})
    spec, cost = cfg.systems["decode"], build_cost(cfg)
    tpot: dict[int, float] = {}  # batch per group -> steady-state TPOT
    why = None
    for b in _BATCHES:
        try:
            tpot[b] = simulate_handed_decode(spec, cost, context, 4, hbm_bytes, b * spec.layout.num_groups)["tpot_s"]
        except ValueError as e:
            why = str(e)
            break
        if slo.tpot_s is not None and tpot[b] > slo.tpot_s:
            why = f"TPOT {tpot[b] * 1e3:.3g} ms at batch {b} per group exceeds the bound"
            break
    mean_b = _operating_batch(tpot, slo)
    if mean_b is None:
        return {"rps": None, "devices": devices, "reason": why or "no batch simulated"}
    t = _interp(tpot, mean_b)
    return {"rps": mean_b * spec.layout.num_groups / (osl * t), "devices": devices, "batch_per_group": mean_b,
            "tpot_s": t, "context": context, "limited_by": why}


_Z = {"mean": 0.0, "p50": 0.0, "p90": 1.2816}  # the standard normal's quantiles


def _operating_batch(tpot: dict[int, float], slo) -> float | None:
    """The largest mean batch per group whose quantile batch still decodes within the TPOT bound.
    Under Poisson arrivals the requests a decode group holds are Poisson-distributed about their
    mean B (an infinite-server queue), so the batch a request sees at the SLO's quantile is about
    B + z·sqrt(B): a group run at the bound on average would miss it half the time."""
    ok = [b for b, t in tpot.items() if slo.tpot_s is None or t <= slo.tpot_s]
    if not ok:
        return None
    if slo.tpot_s is None:
        return float(max(ok))
    z = _Z.get(slo.percentile, 0.0)
    lo, hi = 0.0, float(max(tpot))
    for _ in range(40):
        mid = (lo + hi) / 2
        t = _interp(tpot, mid + z * mid ** 0.5)
        lo, hi = (mid, hi) if t is not None and t <= slo.tpot_s else (lo, mid)
    return lo if lo >= 1e-3 else None


def _interp(tpot: dict[int, float], b: float) -> float | None:
    """TPOT at batch ``b``, linear between the simulated batches (below the first: the first's)."""
    bs = sorted(tpot)
    if b > bs[-1]:
        return None
    if b <= bs[0]:
        return tpot[bs[0]]
    for b0, b1 in zip(bs, bs[1:]):
        if b0 <= b <= b1:
            return tpot[b0] + (tpot[b1] - tpot[b0]) * (b - b0) / (b1 - b0)
    return None


def sides_of(c: Candidate) -> list[tuple[str, dict]]:
    """(side, layout) of what ``compose`` needs for ``c``."""
    if c.kind == "pd":  # a side on hardware of its own is a whole deployment there
        roles = c.system.get("hardware") or {}
        return [(side, {**c.system[side], **({"hardware": {"all": roles[side]}} if side in roles else {})})
                for side in ("prefill", "decode")]
    lay = {k: v for k, v in c.system.items() if k != "engine"}
    return [("prefill", lay), ("decode", lay)]


def compose(c: Candidate, prefill: dict, decode: dict | None, max_devices: int, cores: int | None = None) -> dict:
    """``c``'s estimated SLO rate and goodput per device from its sides (``cores``: the devices are
    processes sharing this many cores, and the rate is per core used)."""
    if c.kind != "pd":
        return _aggregated(c, prefill, decode, cores)
    out = {"name": c.name, "feasible": True, "estimated": True, "prefill_side": prefill, "decode_side": decode}
    if not prefill.get("rps") or not decode.get("rps"):
        why = (decode.get("reason") if not decode.get("rps") else
               prefill.get("reason") or "no prefill rate meets the TTFT bound")
        return {**out, "feasible": False, "reason": _not_simulated(why)}
    s = rate_match(Side("prefill", prefill["devices"], prefill["rps"]), Side("decode", decode["devices"], decode["rps"]),
                   max_devices, cores=cores)
    if s is None:
        return {**out, "feasible": False, "reason": f"one instance of each side needs more than {max_devices} devices"}
    system = {**c.system, "prefill_instances": s.prefill_instances, "decode_instances": s.decode_instances}
    return {**out, "system": system, "devices": s.devices, "used": s.used, "slo_rps": s.rps, "slo_rps_at_least": None,
            "upper_rps": None, "goodput_per_device": s.rps_per_device, "prefill_utilization": s.prefill_utilization,
            "bottleneck": "decode" if s.prefill_utilization < 1 - 1e-9 else "prefill",
            "at_slo": {"tpot_mean_s": decode["tpot_s"]}}


def _aggregated(c: Candidate, prefill: dict, decode: dict | None, cores: int | None) -> dict:
    out = {"name": c.name, "feasible": True, "estimated": True, "prefill_side": prefill, "decode_side": decode}
    if not prefill.get("rps") or (decode is not None and not decode.get("rps")):
        why = prefill.get("reason") or (decode or {}).get("reason") or "no rate meets the SLO on one side"
        return {**out, "feasible": False, "reason": _not_simulated(why)}
    c_, r_ = prefill["rps"], (decode or {}).get("rps")
    rps = c_ * r_ / (c_ + r_) if r_ else c_
    used = min(c.devices, cores or c.devices)
    return {**out, "devices": c.devices, "used": used, "slo_rps": rps, "slo_rps_at_least": None, "upper_rps": None,
            "goodput_per_device": rps / used, "bottleneck": None,
            "at_slo": {"tpot_mean_s": decode["tpot_s"]} if decode else None}


def _not_simulated(why: str) -> str:
    return why if why.startswith("not simulated") else f"not simulated: {why}"


def _mean_prompt(w: dict) -> float:
    from moeflow.measure.workload import WorkloadConfig

    return mean_prompt(WorkloadConfig(**{**w, "rate_rps": 1.0, "num_requests": w.get("num_requests") or 100}))


def memory_gib(hbm_bytes: float, mem_fraction: float, devices: int) -> float:
    """Each process's memory budget: the device's share, or (a host without a device memory figure)
    the host's memory split over the processes."""
    import os

    if hbm_bytes:
        return hbm_bytes * mem_fraction / GIB
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * mem_fraction / devices / GIB
