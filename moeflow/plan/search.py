"""Each candidate's SLO throughput, simulated (pd pairs composed from their sides, ``plan/pd.py``): the bracket-safe search of ``measure.slo`` over the
rate, where a rate meets the SLO when the TTFT quantile is within its bound and the TPOT quantile
within its own (the score is the larger of the two ratios, in TTFT seconds, so the search is the
one ``simulate`` runs). Candidates run in parallel processes; the ranking is goodput per device.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass

from moeflow.experiment.serve import parse_experiment
from moeflow.measure.slo import SloMetric, SloSearch, StopRule, TpotBound, find_slo_rps
from moeflow.plan import estimate
from moeflow.plan.candidates import Candidate, side_devices
from moeflow.plan.progress import Progress
from moeflow.plan.workers import SimulationFailed, Workers
from moeflow.sim.run import build_cost, run_point


_SPAN_TTFTS = 10  # a probe's arrivals span at least this many TTFT bounds
_MAX_REQUESTS = 20_000  # ... up to this many requests
AHEAD = True  # an idle worker simulates the next round's picks ahead of it (False: only each round's, the oracle)


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
        tpot = point.get(self._tpot_key(), point.get("tpot_mean_s"))
        return ttft if tpot is None else max(ttft, tpot / self.tpot_s * self.ttft_s)

    def _tpot_key(self) -> str:
        return f"tpot_{self.percentile}_s"

    def tpot_bound(self) -> TpotBound | None:
        """The TPOT statistic ``score`` reads, for a probe's stop rule (the points carry p50 and p90;
        any other percentile reads the mean)."""
        if self.tpot_s is None:
            return None
        q = {"tpot_p50_s": 0.5, "tpot_p90_s": 0.9}.get(self._tpot_key())
        return TpotBound(self.tpot_s, q)


def evaluate(c: Candidate, base: dict, slo: Slo, start_rps: float | None, probes: int = 4) -> dict:
    """One candidate's search: its SLO rate (or a bound), the point there, and its bottleneck. The
    search starts at ``start_rps``, or (None) at its attention groups over a lone request's latency:
    the rate at which each group would serve one request at a time. Batching raises it and the
    groups' contention for shared workers lowers it; a start above the answer costs little (those
    probes stop early), one far below costs a doubling per factor of two."""
    if not c.feasible:
        return {"name": c.name, "feasible": False, "reason": c.reason}
    cfg = parse_experiment({**base, "rps": [start_rps or 1.0], "systems": {c.name: c.system}})
    cost, spec = build_cost(cfg), cfg.systems[c.name]
    used = min(c.devices, cost.shared_cores or c.devices)  # a CPU host: its processes share its cores
    points: dict[float, dict] = {}
    metric = SloMetric.parse(slo.percentile)
    stop = StopRule(metric, slo.ttft_s, slo.tpot_bound())
    if start_rps is None:
        lone, _ = run_point(spec, cost, cfg, 1e-3, num_requests=1)
        latency = lone["ttft_mean_s"] + (lone.get("tpot_mean_s") or 0.0) * (cfg.workload.output_len - 1)
        start_rps = float(f"{spec.layout.num_groups / latency:.2g}")

    def probe(rate: float) -> float:
        # NOTE: a fixed count of requests at a high rate is a burst shorter than the TTFT bound, which
        # a deployment slower than the rate still serves within it: the arrivals span ten bounds
        n = min(_MAX_REQUESTS, max(cfg.workload.num_requests or 0, math.ceil(rate * _SPAN_TTFTS * slo.ttft_s)))
        p, _ = run_point(spec, cost, cfg, rate, stop=stop, num_requests=n)
        points[rate] = p
        return math.inf if p.get("stopped_early") else slo.score(p)

    # NOTE: 8 halvings: a start from an estimate may be far above the rate (the estimates leave out the
    # sides' interplay); the halvings run only while no rate has met the SLO
    found = find_slo_rps(probe, SloSearch(slo.ttft_s, probes, 0.1, max_halvings=8, metric=metric),
                         {start_rps: probe(start_rps)})
    rps = found.rps if found.rps is not None else found.at_least_rps
    at = points.get(rps) if rps is not None else None
    busy = (at or {}).get("sim_busy") or {}
    return {"name": c.name, "feasible": True, "slo_rps": found.rps, "slo_rps_at_least": found.at_least_rps,
            "upper_rps": found.upper_rps, "goodput_per_device": (rps or 0.0) / used, "used": used,
            "bottleneck": max(busy, key=busy.get) if busy else None, "busy": busy,
            "at_slo": {k: at.get(k) for k in ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s",
                                              "tps_user_mean", "output_tok_s_per_process")} if at else None,
            "start_rps": start_rps, "probes": found.num_probes + 1}


def _one(job):
    t0 = time.perf_counter()
    kind, key, r = _evaluate(job)
    r["wall_s"] = time.perf_counter() - t0
    return kind, key, r


def _evaluate(job):
    kind, key, args = job
    try:
        if kind == "prefill":
            c, base, slo, start = args
            return kind, key, estimate.prefill_side(evaluate(c, estimate.prefill_only(base), Slo(slo.ttft_s, None,
                                                                                               slo.percentile), start), c.devices)
        if kind == "decode":
            return kind, key, estimate.decode_capacity(*args)
        return kind, key, evaluate(*args)
    except ValueError as e:  # the cost model cannot price it (a profile without its expert count): say so
        return kind, key, {"name": key, "feasible": False, "reason": f"not simulated: {e}", "rps": None}


def _job_name(job) -> str:
    kind, key, _ = job
    return f"candidate {key}" if kind == "whole" else f"the {kind} side {key}"


def _simulated(work: list, workers: Workers | None):
    """Each job's result as it ends (simulated in ``workers``, or here when None)."""
    if workers is None:
        return map(_in_process, work)
    return workers.imap_unordered(work, _job_name)


def _in_process(job):
    try:
        return _one(job)
    except Exception as e:
        raise SimulationFailed(f"simulating {_job_name(job)} failed: {type(e).__name__}: {e}") from e


def search(cands: list[Candidate], base: dict, slo: Slo, start_rps: float | None, jobs: int,
           progress=sys.stderr, max_devices: int | None = None, memory_gib: float | None = None,
           hbm_bytes: float = 0.0, confirm: int = 8, top: int = 1, include: tuple[str, ...] = ()) -> list[dict]:
    """Every candidate ranked, best goodput per device first; infeasible ones last. Each is first
    estimated from its sides, each side simulated once (``plan/estimate.py``); then, best estimate
    first, candidates are simulated whole (the SLO search above, ``jobs`` at a time) while an
    estimate beats the best simulated rate or one of the best ``top`` is an estimate, at most
    ``confirm`` of them; those named in ``include`` are simulated whole in any case."""
    ok = [c for c in cands if c.feasible]
    out = [{"name": c.name, "feasible": False, "reason": c.reason} for c in cands if not c.feasible]
    n = max_devices or max((c.devices for c in cands), default=1)
    mem = memory_gib if memory_gib is not None else estimate.memory_gib(hbm_bytes, 0.9, n)
    jobs_by_key: dict[tuple, tuple] = {}
    for c in ok:
        for side, lay in estimate.sides_of(c):
            key = (side, estimate.side_key(lay))
            if side == "prefill":
                engine = {**c.system.get("engine", {})}
                if "prefill" in c.kv_tokens:  # a pd pair: the prefill side's own KV, not the pair's smaller one
                    engine["num_kv_blocks"] = c.kv_tokens["prefill"] // engine.get("kv_block_size", 16)
                args = (Candidate("prefill", {**lay, "engine": engine}, side_devices(lay), "aggregated"), base, slo,
                        start_rps)
            else:
                args = (lay, side_devices(lay), base, slo, mem, hbm_bytes)
            jobs_by_key.setdefault(key, args)
    side_work = [(s_, k_, a) for (s_, k_), a in jobs_by_key.items()]
    shown = Progress(progress, jobs)
    with contextlib.ExitStack() as stack:
        workers = stack.enter_context(Workers(_one, jobs)) if jobs > 1 and side_work else None
        done, walls = {}, []
        for kind, key, r in _simulated(side_work, workers):
            done[(kind, key)] = r
            walls.append(r["wall_s"])
            shown.sides(len(done), len(side_work), walls)
        shown.end()
        cores = shared_cores(base) if ok else None
        est = []
        for c in ok:
            got = {side: done[(side, estimate.side_key(lay))] for side, lay in estimate.sides_of(c)}
            est.append((c, estimate.compose(c, got["prefill"], got.get("decode"), n, cores)))
        _confirm(est, base, slo, start_rps, jobs, workers, shown, confirm, top, include)
    out += [r for _, r in est]
    return sorted(out, key=lambda r: (not r["feasible"], -r.get("goodput_per_device", 0.0), r["name"]))


def _confirm(est: list[tuple[Candidate, dict]], base: dict, slo: Slo, start_rps: float | None, jobs: int,
             workers: Workers | None, shown: Progress, confirm: int, top: int, include: tuple[str, ...]) -> None:
    """``search``'s whole simulations, ``jobs`` a round, each result written over its estimate in ``est``.

    A round waits for its slowest simulation. Meanwhile an idle worker simulates the best estimates
    not yet simulated, ahead of their turn, while ``confirm`` leaves a next round: the estimates
    left keep their order, so that round picks the first of them unless it picks none. The rounds,
    their picks and every result are those without it (``AHEAD = False``). NOTE: a simulation that
    fails ahead of its turn stops the search as one in its round would."""
    confirmed, results = 0, {}  # name -> its whole simulation's result, from its round or ahead of it

    def job(c: Candidate, r: dict) -> tuple:
        # NOTE: from its estimate, not from a lone request's rate: the probes far below the answer took
        # 38-57% of these simulations (the search brackets it either way, to the same 10%)
        start = start_rps or (float(f"{r['slo_rps']:.2g}") if r.get("slo_rps") else None)
        return "whole", r["name"], (_whole(c, r), base, slo, start)
    while True:
        best = sorted((cr for cr in est if cr[1]["feasible"]), key=lambda cr: -cr[1]["goodput_per_device"])
        top_whole = max((r["goodput_per_device"] for _, r in best if not r["estimated"]), default=0.0)
        todo = [cr for k, cr in enumerate(best) if cr[1]["estimated"] and (
            cr[1]["name"] in include or (confirmed < confirm and (k < top or cr[1]["goodput_per_device"] > top_whole)))]
        todo = todo[:max(jobs, 1)]
        if not todo:
            break
        # rounds go on while fewer than ``confirm`` were simulated, then only for ``include``
        estimated = [r for _, r in best if r["estimated"]]
        rounds = -(-max(0, confirm - confirmed) // max(jobs, 1))
        at_most = min(len(estimated), rounds * max(jobs, 1) + sum(r["name"] in include for r in estimated))
        names = [r["name"] for _, r in todo]
        shown.whole(len(todo), at_most)
        if workers is None:
            for k, (_, name, w) in enumerate(map(_in_process, [job(c, r) for c, r in todo]), 1):
                results[name] = w
                shown.whole(len(todo) - k, at_most - k, w["wall_s"])
        else:
            # the next round's picks, as far as ``confirm`` leaves it any
            ahead = [cr for cr in best if cr[1]["estimated"] and cr[1]["name"] not in names]
            ahead = ahead[:max(0, min(jobs, confirm - confirmed - len(todo)))] if AHEAD else []
            _round(workers, [job(c, r) for c, r in todo], results, [job(*cr) for cr in ahead],
                   lambda k, w: shown.whole(len(todo) - k, at_most - k, w["wall_s"]))
        for name in names:
            w, r = results[name], next(r for _, r in est if r["name"] == name)
            r.update(estimated=False, estimated_goodput_per_device=r["goodput_per_device"],
                     **{f: w.get(f) for f in ("slo_rps", "slo_rps_at_least", "upper_rps", "goodput_per_device", "used",
                                              "bottleneck", "busy", "at_slo", "probes", "wall_s", "start_rps")})
            if not w["feasible"]:
                r.update(feasible=False, reason=w.get("reason"))
        confirmed += len(todo)
    shown.end()


def _round(workers: Workers, jobs: list, results: dict, ahead: list, on_done) -> None:
    """Until every one of ``jobs`` has its result in ``results`` (by name): each to a worker once
    one is idle (unless it ran or runs already, ahead of its round), and an idle worker with none of
    them left takes the first of ``ahead`` not simulated yet. ``on_done(k, result)`` when the k-th
    of ``jobs`` has ended."""
    names = {j[1] for j in jobs}
    pending = [j for j in jobs if j[1] not in results and j[1] not in {r[1] for r in workers.running()}]
    while not names <= results.keys():
        unwanted = [j for j in workers.running() if j[1] not in names]
        if pending and not workers.num_idle and unwanted:  # ahead of its turn, and not this round's: cancelled
            workers.cancel(unwanted[-1])
        while pending and workers.num_idle:
            workers.submit(pending.pop(0))
        busy = {r[1] for r in workers.running()} | results.keys()
        for j in ahead:
            if not workers.num_idle:
                break
            if j[1] not in busy:
                workers.submit(j)
                busy.add(j[1])
        (_, name, _), (_, _, w) = workers.next_done(_job_name)
        results[name] = w
        if name in names:
            on_done(sum(n in results for n in names), w)


def shared_cores(base: dict) -> int | None:
    """The cores a CPU host's processes share (the profiled cost's machine); None: devices of their own."""
    cfg = parse_experiment({**base, "rps": [1.0], "systems": {"probe": {"mode": "dep", "dp": 1}}})
    return build_cost(cfg).shared_cores


def _whole(c: Candidate, r: dict) -> Candidate:
    """The candidate as simulated whole: a pd pair with the instance counts its rate matching chose."""
    if c.kind != "pd":
        return c
    return Candidate(c.name, {**c.system, **r["system"]}, r["devices"], "pd", kv_tokens=c.kv_tokens)
