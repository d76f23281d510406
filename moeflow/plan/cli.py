"""``moeflow plan``: which deployment of N devices serves a workload within an SLO at the most
requests per second per device, by simulation of every candidate (``plan/candidates.py``)."""
from __future__ import annotations

import argparse
import dataclasses
import time

from moeflow.config import ConfigError
from moeflow.plan.question import PERCENTILES, PlanQuestion

TOP = 10
Q = PlanQuestion  # the flags' defaults are the question's


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="search the deployments of N devices for the best goodput per device (simulated)")
    p.add_argument("--model", required=True, help="a model preset of the simulator (or a checkpoint directory)")
    p.add_argument("--hardware", default=None,
                   help="a hardware preset (sim/hardware.py), for the analytic cost; roles of disaggregated layouts "
                        "on others: gb200,attention=h200 (roles: attention, ffn, prefill, decode)")
    p.add_argument("--price", default=None, metavar="PRESET=USD,...",
                   help="price per device-hour of each preset (defaults: sim/prices.py, one provider's list)")
    p.add_argument("--rank-by", default=Q.rank_by, choices=("device", "cost"),
                   help="rank by goodput per device or per USD (default %(default)s)")
    p.add_argument("--profile", default=None, metavar="P.json",
                   help="this machine's `moeflow profile`: the profiled cost instead (hardware cpu-here)")
    p.add_argument("--devices", type=int, required=True, help="devices (processes) the deployment may use")
    p.add_argument("--isl", type=int, required=True, help="prompt tokens per request (uniform down to half with --isl-ratio)")
    p.add_argument("--isl-ratio", type=float, default=Q.isl_ratio, help="shortest prompt / longest (1: every prompt --isl long)")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    p.add_argument("--ttft-s", type=float, required=True, help="TTFT bound (seconds) at --percentile")
    p.add_argument("--tpot-ms", type=float, default=None, help="TPOT bound (milliseconds) at --percentile")
    p.add_argument("--percentile", default=Q.percentile, choices=PERCENTILES, help="of TTFT and TPOT")
    p.add_argument("--kinds", default=",".join(Q.kinds), help="aggregated, pd or both (comma-separated)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="every layout's batch limit in tokens (default: each mode's own; the engine's flag of the name)")
    p.add_argument("--mem-fraction", type=float, default=Q.mem_fraction, help="share of a device's memory a process may hold")
    p.add_argument("--num-requests", type=int, default=Q.num_requests,
                   help="requests per simulated probe (every rate the same count: a probe's cost does not grow with it)")
    p.add_argument("--start-rps", type=float, default=None,
                   help="the search's first rate (default: per candidate, one over a lone request's latency)")
    p.add_argument("--jobs", type=int, default=Q.jobs, help="candidates simulated at once (processes)")
    p.add_argument("--confirm", type=int, default=Q.confirm,
                   help="at most this many candidates simulated whole after their estimates, best estimate first, "
                        "while an estimate beats the best simulated rate or --top has estimates left (default %(default)s)")
    p.add_argument("--top", type=int, default=Q.top, help="the best this many are all simulated whole (default %(default)s)")
    p.add_argument("--include", action="append", default=[], metavar="NAME",
                   help="also simulate this candidate whole, whatever its estimate (repeatable): a deployment to compare")
    d = p.add_argument_group("a workload that drifts: which deployment, fixed or elastic (--autoscale), serves this "
                             "trace with the most good requests per device-second (docs/plan.md)")
    d.add_argument("--request-rate", dest="rps", type=float, default=None,
                   help="the base arrival rate (requests/s; vLLM's flag of the name)")
    d.add_argument("--rate-curve", default=None, metavar="T:F,...",
                   help="the rate at t is --request-rate x F, linear between knots, flat beyond (e.g. 0:1,100:3,200:1)")
    d.add_argument("--length-curve", default=None, metavar="T:F,...",
                   help="a prompt arriving at t is F x its drawn length (e.g. 0:1,200:4)")
    d.add_argument("--duration-s", type=float, default=Q.duration_s, help="the trace's length (default %(default)s)")
    d.add_argument("--repeats", type=int, default=Q.repeats,
                   help="seeds each candidate is simulated with; the verdict is their median (default %(default)s)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return answer(PlanQuestion.from_args(args), args.json)


def answer(q: PlanQuestion, json_path: str | None = None) -> int:
    """Print the ranking and the best deployment's command; write the whole answer to ``json_path``."""
    from moeflow.measure.provenance import write_json
    from moeflow.plan import accuracy, pareto
    from moeflow.plan.candidates import candidates_for
    from moeflow.plan.command import engine_runs, serve_command
    from moeflow.plan.hardware import HardwareChoice
    from moeflow.plan.search import Slo, search, shared_cores
    from moeflow.sim.hardware import hardware_preset
    from moeflow.sim.model_spec import model_preset

    if q.drifts:
        from moeflow.plan.drift import answer_drift

        return answer_drift(q, json_path)
    m = model_preset(q.model)
    choice = HardwareChoice.parse(q.hardware, q.price) if q.hardware else None
    hw = hardware_preset(choice.default) if choice else None
    base = q.experiment_base(q.isl, choice.default if choice else None)
    slo = Slo(q.ttft_s, None if q.tpot_ms is None else q.tpot_ms / 1e3, q.percentile)
    cands = candidates_for(q, m, choice, hw, q.isl)
    unknown = sorted(set(q.include) - {c.name for c in cands})
    if unknown:
        raise ConfigError(f"--include {unknown}: not among the candidates (e.g. {', '.join(c.name for c in cands[:4])})")
    feasible = sum(c.feasible for c in cands)
    on = choice.default + "".join(f", {r} on {p}" for r, p in choice.roles) if choice else "this machine (profiled)"
    print(f"moeflow plan: {len(cands)} deployments of {q.devices} devices ({feasible} fit in memory), "
          f"{q.model} on {on}, ISL {q.isl} OSL {q.osl}, "
          f"SLO {q.percentile} TTFT <= {q.ttft_s:g} s" + (f", TPOT <= {q.tpot_ms:g} ms" if q.tpot_ms else ""))
    t0 = time.monotonic()
    from moeflow.plan.estimate import memory_gib

    ranked = search(cands, base, slo, q.start_rps, q.jobs, max_devices=q.devices,
                    memory_gib=memory_gib(hw.hbm_bytes if hw else 0.0, q.mem_fraction, q.devices),
                    hbm_bytes=hw.hbm_bytes if hw else 0.0, confirm=q.confirm, top=q.top,
                    include=q.include)
    wall = time.monotonic() - t0
    by_name = {c.name: c for c in cands}
    for r in ranked:
        system = {**by_name[r["name"]].system, **(r.get("system") or {})}  # pd: with its instance counts
        r["layout"] = system
        r["command"] = serve_command(q.model, system) if r["feasible"] else None
        r["engine_note"] = engine_runs(system)
    pareto.price(ranked, choice, q.osl)
    ranked = pareto.rank(ranked, q.rank_by)
    _print(ranked, wall, shared_cores(base) is not None, q.rank_by)
    if choice is not None:
        if choice.unpriced():
            print(f"no price per device-hour for {choice.unpriced()}: --price {choice.unpriced()[0]}=USD prices them")
        print("\n".join(pareto.show([r for r in ranked if r["feasible"]], _name)))
    best = next((r for r in ranked if r["feasible"] and (r.get(pareto.RANK_KEY[q.rank_by]) or 0) > 0), None)
    if best is not None:
        how = f" ({_why_estimated(best, q.confirm)})" if best.get("estimated") else ""
        print(f"\nbest: {_name(best)}{how}\n  {best['command'] or best['engine_note']}")
        if best["layout"].get("hardware"):
            print("  with " + ", ".join(f"its {r} processes on {p} devices" for r, p in best["layout"]["hardware"].items()))
        best["accuracy"] = accuracy.closest(best["layout"], profiled=q.profile is not None)
        print("  the simulator's measured error on the closest validated cases:")
        for line in best["accuracy"]:
            print(f"    {line}")
        runnable = next((r for r in ranked if r["command"] and r["goodput_per_device"] > 0), None)
        if runnable is not None and runnable is not best:
            print(f"best that moeflow's engine runs: {_name(runnable)}\n  {runnable['command']}")
    if json_path:
        write_json(json_path, {"inputs": dataclasses.asdict(q), "wall_s": wall,
                               "candidates": ranked, "best": best})
    return 0


def _name(r: dict) -> str:
    """A pd pair with its instance counts (2x dep1 -> 3x afd_1a1f); others as enumerated."""
    lay = r.get("layout") or {}
    if lay.get("mode") != "pd" or "prefill_instances" not in lay:
        return r["name"]
    name, at, roles = r["name"].partition("@")
    p, d = _sides_of(name)
    return f"pd {lay['prefill_instances']}x{p} -> {lay['decode_instances']}x{d}" + (f" @{roles}" if at else "")


def _sides_of(name: str) -> tuple[str, str]:
    """pd_<prefill>_<decode> -> (prefill, decode): the decode side is the last dep or afd part."""
    for dmode in ("_dep", "_afd"):
        k = name.rfind(dmode)
        if k > 3:
            return name[3:k], name[k + 1:]
    return name, ""


def _why_estimated(best: dict, confirm: int) -> str:
    """Why the answer is an estimate and how to simulate it: the search's whole simulations
    (--confirm) ran out on candidates whose estimates ranked higher."""
    spent = f"--confirm's {confirm} whole simulations went to others" if confirm else "--confirm 0 simulates none"
    return f"estimated from its sides, not simulated whole: {spent}; --include {best['name']} simulates it"


def _print(ranked: list[dict], wall: float, cpu_host: bool, rank_by: str = "device") -> None:
    """The top ``TOP``; ``cpu_host``: the profiled cost of a machine whose cores the processes share."""
    print(f"searched {len(ranked)} candidates in {wall:.1f} s; the top {TOP} by goodput per "
          f"{'USD' if rank_by == 'cost' else 'device'} (~: estimated from its sides, not simulated whole):")
    print(f"  {'deployment':<40} {'SLO rps':>9} {'rps/device':>10} {'req/USD':>8} {'TTFT p90':>9} {'TPOT p90':>9}  bottleneck"
          + ("  (rps/device: per core used, the processes sharing this host's cores)" if cpu_host else ""))
    for r in [r for r in ranked if r["feasible"]][:TOP]:
        rps = f"{r['slo_rps']:.3g}" if r["slo_rps"] is not None else (
            f">={r['slo_rps_at_least']:.3g}" if r["slo_rps_at_least"] is not None else "none")
        at = r["at_slo"] or {}
        ttft = f"{at['ttft_p90_s']:.3g}s" if at.get("ttft_p90_s") is not None else "-"
        tpot = f"{at['tpot_p90_s'] * 1e3:.3g}ms" if at.get("tpot_p90_s") is not None else "-"
        name = _name(r)
        usd = format(r["requests_per_usd"], ".4g") if r.get("requests_per_usd") else "-"
        print(f"  {name:<40} {rps:>9} {('~' if r.get('estimated') else '') + format(r['goodput_per_device'], '.3g'):>10} "
              f"{usd:>8} {ttft:>9} {tpot:>9}  {r['bottleneck'] or '-'}")
    bad = [r for r in ranked if not r["feasible"]]
    if bad:
        print(f"  not ranked: {len(bad)} (memory, or a cost model that cannot price them), e.g. "
              f"{bad[0]['name']}: {bad[0]['reason']}")
