"""Each candidate's SLO throughput, simulated: the bracket-safe search of ``measure.slo`` over the
rate, where a rate meets the SLO when the TTFT quantile is within its bound and the TPOT quantile
within its own (the score is the larger of the two ratios, in TTFT seconds, so the search is the
one ``simulate`` runs). Candidates run in parallel processes; the ranking is goodput per device.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import sys
from dataclasses import dataclass

from moeflow.experiment.serve import parse_experiment
from moeflow.measure.slo import SloMetric, SloSearch, StopRule, find_slo_rps
from moeflow.plan.candidates import Candidate
from moeflow.sim.run import build_cost, run_point


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float | None  # None: TTFT only
    percentile: str = "p90"  # of TTFT over every request (nearest rank), and of TPOT over completed ones

    def score(self, point: dict) -> float:
        """The point's TTFT quantile, scaled up by how far TPOT misses its bound: <= ttft_s exactly
        when both are met."""
        ttft = SloMetric.parse(self.percentile).score(point)
        if self.tpot_s is None or not point.get("completed"):
            return ttft
        tpot = point.get(f"tpot_{self.percentile}_s", point.get("tpot_mean_s"))
        return ttft if tpot is None else max(ttft, tpot / self.tpot_s * self.ttft_s)


def evaluate(c: Candidate, base: dict, slo: Slo, start_rps: float | None, probes: int = 4) -> dict:
    """One candidate's search: its SLO rate (or a bound), the point there, and its bottleneck. The
    search starts at ``start_rps``, or (None) at one over a lone request's latency: the rate at
    which the deployment would serve one request at a time, which batching only raises."""
    if not c.feasible:
        return {"name": c.name, "feasible": False, "reason": c.reason}
    cfg = parse_experiment({**base, "rps": [start_rps or 1.0], "systems": {c.name: c.system}})
    cost, spec = build_cost(cfg), cfg.systems[c.name]
    points: dict[float, dict] = {}
    metric = SloMetric.parse(slo.percentile)
    if start_rps is None:
        lone, _ = run_point(spec, cost, cfg, 1e-3, num_requests=1)
        latency = lone["ttft_mean_s"] + (lone.get("tpot_mean_s") or 0.0) * (cfg.workload.output_len - 1)
        start_rps = float(f"{1 / latency:.2g}")

    def probe(rate: float) -> float:
        p, _ = run_point(spec, cost, cfg, rate, stop=StopRule(metric, slo.ttft_s))
        points[rate] = p
        return math.inf if p.get("stopped_early") else slo.score(p)

    found = find_slo_rps(probe, SloSearch(slo.ttft_s, probes, 0.1, metric=metric), {start_rps: probe(start_rps)})
    rps = found.rps if found.rps is not None else found.at_least_rps
    at = points.get(rps) if rps is not None else None
    busy = (at or {}).get("sim_busy") or {}
    return {"name": c.name, "feasible": True, "slo_rps": found.rps, "slo_rps_at_least": found.at_least_rps,
            "upper_rps": found.upper_rps, "goodput_per_device": (rps or 0.0) / c.devices,
            "bottleneck": max(busy, key=busy.get) if busy else None, "busy": busy,
            "at_slo": {k: at.get(k) for k in ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s",
                                              "tps_user_mean", "output_tok_s_per_process")} if at else None,
            "start_rps": start_rps, "probes": found.num_probes + 1}


def _one(job):
    try:
        return evaluate(*job)
    except ValueError as e:  # the cost model cannot price it (a profile without its expert count): say so
        return {"name": job[0].name, "feasible": False, "reason": f"not simulated: {e}"}


def search(cands: list[Candidate], base: dict, slo: Slo, start_rps: float | None, jobs: int,
           progress=sys.stderr) -> list[dict]:
    """Every candidate evaluated (``jobs`` processes), best goodput per device first; infeasible ones last."""
    work = [(c, base, slo, start_rps) for c in cands]
    out = []
    if jobs <= 1:
        results = map(_one, work)
        pool = None
    else:
        pool = mp.get_context("spawn").Pool(jobs)
        results = pool.imap_unordered(_one, work)
    try:
        for k, r in enumerate(results, 1):
            out.append(r)
            if progress is not None:
                bar = "#" * (30 * k // len(work))
                print(f"\rplan: [{bar:<30}] {k}/{len(work)} candidates", end="", file=progress, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if progress is not None:
            print(file=progress)
    return sorted(out, key=lambda r: (not r["feasible"], -r.get("goodput_per_device", 0.0), r["name"]))
