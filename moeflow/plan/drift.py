"""``moeflow plan --request-rate R --rate-curve ... --length-curve ...``: which deployment of at most N
devices, fixed or elastic, serves a trace whose rate and prompt lengths drift with the most good
requests (within both SLOs) per device-second, each device paid from its start to its exit.

1. Every layout of the stationary search is estimated from its sides (``search``'s first stage,
   no whole simulation) at the trace's shortest and longest prompts.
2. Each becomes a family sized at what the trace needs (``plan/drift_candidates.py``): fixed sizes
   at quantiles of the need, and an elastic deployment the controller resizes; each estimated
   (``plan/drift_sizes.py``).
3. The best ``--top`` fixed and ``--top`` elastic estimates, then the best others up to
   ``--confirm``, and every ``--include``, are simulated whole on the trace (the simulator runs
   the engine's own controllers, ``sim/elastic_*.py``) with ``--repeats`` seeds; they rank by the
   median of their good requests per process-second.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time

from moeflow.config import ConfigError
from moeflow.plan.drift_candidates import DriftCandidate, Policy, aggregated, pd
from moeflow.plan.drift_sizes import MOMENTS, length_range, moments

TOP = 12


def simulate(job: tuple) -> dict:
    """One candidate on the trace, once per seed (a worker's job)."""
    from moeflow.experiment.serve import parse_experiment
    from moeflow.sim.run import build_cost, run_point

    name, system, base, repeats = job
    t0 = time.perf_counter()
    try:
        cfg = parse_experiment({**base, "systems": {name: system}})
        spec, cost = cfg.systems[name], build_cost(cfg)
        runs = []
        for seed in range(repeats):
            p, _ = run_point(spec, cost, cfg, cfg.rps[0], seed)
            runs.append({"seed": seed, "good_per_process_s": p.get("goodput_per_process_s", 0.0),
                         "within": p.get("slo_attainment"), "process_s": p["process_s"],
                         "mean_processes": p["process_s"] / p["duration_s"] if p["duration_s"] else None,
                         "ttft_p90_s": p.get("ttft_p90_s"), "tpot_p90_s": p.get("tpot_p90_s"),
                         "changes": len(p.get("membership_changes", []))})
    except (ValueError, ConfigError) as e:  # a layout the simulator cannot run elastic, or cannot price
        return {"name": name, "simulated": False, "reason": f"not simulated: {e}", "wall_s": time.perf_counter() - t0}
    med = statistics.median(r["good_per_process_s"] for r in runs)
    return {"name": name, "simulated": True, "good_per_process_s": med,
            "range": [min(r["good_per_process_s"] for r in runs), max(r["good_per_process_s"] for r in runs)],
            "within": statistics.median(r["within"] for r in runs),
            "mean_processes": statistics.median(r["mean_processes"] for r in runs), "runs": runs,
            "wall_s": time.perf_counter() - t0}


def pick(cands: list[DriftCandidate], top: int, confirm: int, include: tuple[str, ...]) -> list[DriftCandidate]:
    """Which to simulate whole: the best ``top`` fixed and ``top`` elastic estimates (the answer
    compares the two), then the best others while fewer than ``confirm``, and every ``include``."""
    best = sorted(cands, key=lambda c: (-c.estimate.good_per_device_s, c.name))
    chosen = [c for c in best if not c.elastic][:top] + [c for c in best if c.elastic][:top]
    chosen += [c for c in best if c not in chosen][:max(0, confirm - len(chosen))]
    chosen += [c for c in best if c.name in include and c not in chosen]
    return sorted(chosen, key=best.index)


def answer_drift(q, json_path: str | None = None) -> int:
    from moeflow.measure.provenance import write_json
    from moeflow.plan.candidates import candidates_for, memory_fit
    from moeflow.plan.command import autoscale_flags, engine_runs, serve_command
    from moeflow.plan.estimate import memory_gib
    from moeflow.plan.hardware import HardwareChoice
    from moeflow.plan.search import Slo, search
    from moeflow.plan.workers import Workers
    from moeflow.sim.hardware import hardware_preset
    from moeflow.sim.model_spec import model_preset

    m = model_preset(q.model)
    choice = HardwareChoice.parse(q.hardware, q.price) if q.hardware else None
    preset = choice.default if choice else None
    hw = hardware_preset(preset) if choice else None
    lo, hi = length_range(q.length_curve, q.duration_s)
    longest = math.ceil(q.isl * hi)
    cands = candidates_for(q, m, choice, hw, longest)
    slo = Slo(q.ttft_s, q.tpot_ms / 1e3, q.percentile)
    on = choice.default + "".join(f", {r} on {p}" for r, p in choice.roles) if choice else "this machine (profiled)"
    print(f"moeflow plan: a drifting trace, {q.rps:g} rps x {_curve(q.rate_curve)} for {q.duration_s:g} s, prompts up "
          f"to {q.isl} x {_curve(q.length_curve)}, OSL {q.osl}, {q.model} on {on}, at most {q.devices} devices, SLO "
          f"{q.percentile} TTFT <= {q.ttft_s:g} s, TPOT <= {q.tpot_ms:g} ms; {len(cands)} layouts "
          f"({sum(c.feasible for c in cands)} fit the longest prompts)")
    t0 = time.monotonic()
    mem = memory_gib(hw.hbm_bytes if hw else 0.0, q.mem_fraction, q.devices)
    est = {}
    for f in sorted({lo, hi}):
        ranked = search(cands, q.experiment_base(max(1, round(q.isl * f)), preset), slo, None, q.jobs,
                        max_devices=q.devices, memory_gib=mem, hbm_bytes=hw.hbm_bytes if hw else 0.0, confirm=0, top=0)
        est[f] = {r["name"]: r for r in ranked}
    ms = moments(q.rps, q.rate_curve, q.length_curve, q.duration_s)
    policy = Policy(q.tpot_ms / 1e3, q.ttft_s, moment_s=q.duration_s / MOMENTS)

    fits = memory_fit(q, m, choice, hw, longest)
    drift = []
    for c in cands:
        r_lo, r_hi = est[lo].get(c.name, {}), est[hi].get(c.name, {})
        if not (c.feasible and r_lo.get("feasible") and r_hi.get("feasible")):
            continue
        if c.kind == "pd":
            drift += pd(c, ((lo, r_lo["prefill_side"]["rps"]), (hi, r_hi["prefill_side"]["rps"])),
                        ((lo, r_lo["decode_side"]["rps"]), (hi, r_hi["decode_side"]["rps"])), ms, q.devices, policy)
        elif r_lo.get("slo_rps") and r_hi.get("slo_rps"):
            drift += aggregated(c, (lo, r_lo["slo_rps"]), (hi, r_hi["slo_rps"]), ms, q.devices, fits, policy)
    unknown = sorted(set(q.include) - {c.name for c in drift})
    if unknown:
        raise ConfigError(f"--include {unknown}: not among the drifting candidates (e.g. "
                          f"{', '.join(c.name for c in drift[:4])})")
    if not drift:
        print("no layout has an estimate at both ends of the trace's prompt lengths: nothing to size")
        return 1
    chosen = pick(drift, q.top, q.confirm, q.include)
    base = _trace_base(q, preset)
    whole = {}
    print(f"\n{len(drift)} sized deployments ({sum(c.elastic for c in drift)} elastic); simulating {len(chosen)} whole "
          f"on the trace, {q.repeats} seed{'s' if q.repeats > 1 else ''} each", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        workers = stack.enter_context(Workers(simulate, q.jobs)) if q.jobs > 1 else None
        _simulate(chosen, base, q.repeats, workers, whole, t0)
        # the answer weighs the best elastic deployment against every fixed size of its own layout too
        ok = [c for c in chosen if c.elastic and whole[c.name]["simulated"]]
        if ok:
            top = max(ok, key=lambda c: whole[c.name]["good_per_process_s"])
            own = [c for c in drift if c.family == top.family and not c.elastic and c.name not in whole]
            if own:
                print(f"\nand the {len(own)} other fixed sizes of {top.family}", file=sys.stderr)
                _simulate(own, base, q.repeats, workers, whole, t0)
    print(file=sys.stderr)
    wall = time.monotonic() - t0
    rows = [_row(c, whole.get(c.name)) for c in drift]
    rows.sort(key=lambda r: (not r["simulated"], -(r["good_per_process_s"] if r["simulated"] else r["estimate"]
                                                   ["good_per_device_s"]), r["name"]))
    _print(rows, wall)
    best = next((r for r in rows if r["simulated"] and r["good_per_process_s"] > 0), None)
    if best is not None:
        print(f"\nbest: {best['name']}")
        if best["elastic"]:
            fixed = [r for r in rows if r["simulated"] and not r["elastic"]]
            own = [r for r in fixed if r["family"] == best["family"]]
            for what, rs in (("of the fixed deployments simulated whole", fixed), ("of its own layout's fixed sizes", own)):
                if rs and rs[0]["good_per_process_s"]:
                    print(f"  {best['good_per_process_s'] / rs[0]['good_per_process_s']:.2f}x the best {what} "
                          f"({rs[0]['name']}, {len(rs)} simulated)")
        layout = {k: v for k, v in best["system"].items() if k != "autoscale"}
        cmd = serve_command(q.model, layout)
        best["command"] = None if cmd is None else cmd + (" " + autoscale_flags(best["system"]) if best["elastic"] else "")
        print(f"  {best['command'] or engine_runs(layout)}")
        if best["elastic"]:
            print("  POLICY.yaml: " + ", ".join(f"{k}: {v}" for k, v in best["system"]["autoscale"].items()))
    if json_path:
        write_json(json_path, {"inputs": dataclasses.asdict(q), "wall_s": wall, "length_range": [lo, hi],
                               "moments": [m_.__dict__ for m_ in ms], "candidates": rows, "best": best})
    return 0


def _simulate(cands: list[DriftCandidate], base: dict, repeats: int, workers, whole: dict, t0: float) -> None:
    """Each of ``cands`` simulated whole on the trace (in ``workers``, or here when None), into ``whole``."""
    jobs = [(c.name, c.system, base, repeats) for c in cands]
    done = workers.imap_unordered(jobs, lambda j: f"candidate {j[0]}") if workers else map(simulate, jobs)
    for k, r in enumerate(done, 1):
        whole[r["name"]] = r
        print(f"\rplan: whole simulations {k}/{len(jobs)} ({time.monotonic() - t0:.0f} s)", end="", file=sys.stderr,
              flush=True)


def _trace_base(q, preset: str | None) -> dict:
    """The experiment every whole simulation runs: the trace itself."""
    b = q.experiment_base(q.isl, preset)
    w = {k: v for k, v in b["workload"].items() if k != "num_requests"}
    return {**b, "rps": [q.rps], "workload": {**w, "duration_s": q.duration_s,
                                              "rate_curve": [list(k) for k in q.rate_curve],
                                              "length_curve": [list(k) for k in q.length_curve]}}


def _row(c: DriftCandidate, w: dict | None) -> dict:
    r = {"name": c.name, "family": c.family, "elastic": c.elastic, "devices": c.devices, "system": c.system,
         "estimate": c.estimate.to_dict(), "simulated": bool(w and w["simulated"])}
    if w:
        r.update({k: v for k, v in w.items() if k not in ("name", "simulated")})
    return r


def _median(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def _curve(curve) -> str:
    return "(" + ", ".join(f"{t:g}s:{f:g}" for t, f in curve) + ")" if curve else "1"


def _print(rows: list[dict], wall: float) -> None:
    print(f"searched in {wall:.0f} s; the top {TOP} by good requests per device-second "
          "(simulated whole, median over seeds; ~: estimated only):")
    print(f"  {'deployment':<36} {'devices':>8} {'estimate':>9} {'simulated (min-max)':>24} {'within':>7} "
          f"{'TTFT p90':>9} {'TPOT p90':>9} {'changes':>7}")
    for r in rows[:TOP]:
        dev = f"<={r['devices']}" if r["elastic"] else str(r["devices"])
        if r["simulated"]:
            mean = statistics.median(x["changes"] for x in r["runs"])
            sim = f"{r['good_per_process_s']:.4g} ({r['range'][0]:.4g}-{r['range'][1]:.4g})"
            ttft, tpot = (_median(r["runs"], k) for k in ("ttft_p90_s", "tpot_p90_s"))
            ttft = f"{ttft:.3g}s" if ttft is not None else "-"
            tpot = f"{tpot * 1e3:.3g}ms" if tpot is not None else "-"
            print(f"  {r['name']:<36} {dev:>8} {r['estimate']['good_per_device_s']:>9.4g} {sim:>24} "
                  f"{r['within']:>7.0%} {ttft:>9} {tpot:>9} {mean:>7g}")
        else:
            why = r.get("reason") or "estimated only"
            print(f"  {r['name']:<36} {dev:>8} ~{r['estimate']['good_per_device_s']:>8.4g}   {why}")
