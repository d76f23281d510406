"""``moeflow plan``: which deployment of N devices serves a workload within an SLO at the most
requests per second per device, by simulation of every candidate (``plan/candidates.py``)."""
from __future__ import annotations

import argparse
import time

from moeflow.config import ConfigError

TOP = 10


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="search the deployments of N devices for the best goodput per device (simulated)")
    p.add_argument("--model", required=True, help="a model preset of the simulator (or a checkpoint directory)")
    p.add_argument("--hardware", default=None, help="a hardware preset (sim/hardware.py), for the analytic cost")
    p.add_argument("--profile", default=None, metavar="P.json",
                   help="this machine's `moeflow profile`: the profiled cost instead (hardware cpu-here)")
    p.add_argument("--devices", type=int, required=True, help="devices (processes) the deployment may use")
    p.add_argument("--isl", type=int, required=True, help="prompt tokens per request (uniform down to half with --isl-ratio)")
    p.add_argument("--isl-ratio", type=float, default=1.0, help="shortest prompt / longest (1: every prompt --isl long)")
    p.add_argument("--osl", type=int, required=True, help="output tokens per request")
    p.add_argument("--ttft-s", type=float, required=True, help="TTFT bound (seconds) at --percentile")
    p.add_argument("--tpot-ms", type=float, default=None, help="TPOT bound (milliseconds) at --percentile")
    p.add_argument("--percentile", default="p90", choices=["mean", "p50", "p90"], help="of TTFT and TPOT")
    p.add_argument("--kinds", default="aggregated,pd", help="aggregated, pd or both (comma-separated)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="every layout's batch limit in tokens (default: each mode's own; the engine's flag of the name)")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of a device's memory a process may hold")
    p.add_argument("--num-requests", type=int, default=100,
                   help="requests per simulated probe (every rate the same count: a probe's cost does not grow with it)")
    p.add_argument("--start-rps", type=float, default=None,
                   help="the search's first rate (default: per candidate, one over a lone request's latency)")
    p.add_argument("--jobs", type=int, default=2, help="candidates simulated at once (processes)")
    p.add_argument("--confirm", type=int, default=8,
                   help="at most this many candidates simulated whole after their estimates, best estimate first, "
                        "while an estimate beats the best simulated rate or --top has estimates left (default 8)")
    p.add_argument("--top", type=int, default=3, help="the best this many are all simulated whole (default 3)")
    p.add_argument("--include", action="append", default=[], metavar="NAME",
                   help="also simulate this candidate whole, whatever its estimate (repeatable): a deployment to compare")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.provenance import write_json
    from moeflow.plan.candidates import check_memory, enumerate_candidates, with_batch_tokens
    from moeflow.plan.command import engine_runs, serve_command
    from moeflow.plan.search import Slo, search, shared_cores
    from moeflow.sim.hardware import hardware_preset
    from moeflow.sim.model_spec import model_preset

    if args.devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {args.devices}")
    if (args.hardware is None) == (args.profile is None):
        raise ConfigError("give one of --hardware PRESET (the analytic cost) or --profile P.json (the profiled cost "
                          "of the machine that measured it)")
    kinds = tuple(k.strip() for k in args.kinds.split(","))
    if not set(kinds) <= {"aggregated", "pd"}:
        raise ConfigError(f"--kinds: aggregated and/or pd, got {args.kinds!r}")
    m = model_preset(args.model)
    target = ({"hardware": "cpu-here", "cost": "profiled", "profile": args.profile} if args.profile
              else {"hardware": args.hardware})
    hw = hardware_preset(args.hardware) if args.hardware else None
    workload = {"kind": "fixed", "fixed_len": args.isl} if args.isl_ratio == 1 else \
        {"kind": "uniform", "isl": args.isl, "isl_ratio": args.isl_ratio}
    base = {"model": args.model, **target, "slo_ttft_s": args.ttft_s, "slo_metric": args.percentile,
            "workload": {**workload, "output_len": args.osl, "num_requests": args.num_requests, "seed": 0}}
    if args.tpot_ms is not None:
        base["slo_tpot_s"] = args.tpot_ms / 1e3
    slo = Slo(args.ttft_s, None if args.tpot_ms is None else args.tpot_ms / 1e3, args.percentile)
    if args.max_batch_tokens is not None and args.max_batch_tokens < args.isl:
        raise ConfigError(f"--max-batch-tokens {args.max_batch_tokens} is below --isl {args.isl}: a prompt would not fit")
    cands = [check_memory(with_batch_tokens(c, args.max_batch_tokens), m, hw.hbm_bytes if hw else 0.0,
                          args.mem_fraction, args.isl + args.osl, max_batch_tokens=args.max_batch_tokens or max(8192, args.isl),
                          max_num_seqs=256, block_size=16)
             for c in enumerate_candidates(args.devices, kinds)]
    unknown = sorted(set(args.include) - {c.name for c in cands})
    if unknown:
        raise ConfigError(f"--include {unknown}: not among the candidates (e.g. {', '.join(c.name for c in cands[:4])})")
    feasible = sum(c.feasible for c in cands)
    print(f"moeflow plan: {len(cands)} deployments of {args.devices} devices ({feasible} fit in memory), "
          f"{args.model} on {args.hardware or 'this machine (profiled)'}, ISL {args.isl} OSL {args.osl}, "
          f"SLO {args.percentile} TTFT <= {args.ttft_s:g} s" + (f", TPOT <= {args.tpot_ms:g} ms" if args.tpot_ms else ""))
    t0 = time.monotonic()
    from moeflow.plan.estimate import memory_gib

    ranked = search(cands, base, slo, args.start_rps, args.jobs, max_devices=args.devices,
                    memory_gib=memory_gib(hw.hbm_bytes if hw else 0.0, args.mem_fraction, args.devices),
                    hbm_bytes=hw.hbm_bytes if hw else 0.0, confirm=args.confirm, top=args.top,
                    include=tuple(args.include))
    wall = time.monotonic() - t0
    by_name = {c.name: c for c in cands}
    for r in ranked:
        system = {**by_name[r["name"]].system, **(r.get("system") or {})}  # pd: with its instance counts
        r["layout"] = system
        r["command"] = serve_command(args.model, system) if r["feasible"] else None
        r["engine_note"] = engine_runs(system)
    _print(ranked, wall, cpu_host=shared_cores(base) is not None)
    best = next((r for r in ranked if r["feasible"] and r["goodput_per_device"] > 0), None)
    if best is not None:
        how = " (estimated from its sides; --top 1 simulates it whole)" if best.get("estimated") else ""
        print(f"\nbest: {_name(best)}{how}\n  {best['command'] or best['engine_note']}")
        runnable = next((r for r in ranked if r["command"] and r["goodput_per_device"] > 0), None)
        if runnable is not None and runnable is not best:
            print(f"best that moeflow's engine runs: {_name(runnable)}\n  {runnable['command']}")
    if args.json:
        write_json(args.json, {"inputs": {k: v for k, v in vars(args).items() if k != "func"}, "wall_s": wall,
                               "candidates": ranked, "best": best})
    return 0


def _name(r: dict) -> str:
    """A pd pair with its instance counts (2x dep1 -> 3x afd_1a1f); others as enumerated."""
    lay = r.get("layout") or {}
    if lay.get("mode") != "pd" or "prefill_instances" not in lay:
        return r["name"]
    p, d = _sides_of(r["name"])
    return f"pd {lay['prefill_instances']}x{p} -> {lay['decode_instances']}x{d}"


def _sides_of(name: str) -> tuple[str, str]:
    """pd_<prefill>_<decode> -> (prefill, decode): the decode side is the last dep or afd part."""
    for dmode in ("_dep", "_afd"):
        k = name.rfind(dmode)
        if k > 3:
            return name[3:k], name[k + 1:]
    return name, ""


def _print(ranked: list[dict], wall: float, cpu_host: bool) -> None:
    """The top ``TOP``; ``cpu_host``: the profiled cost of a machine whose cores the processes share."""
    print(f"searched {len(ranked)} candidates in {wall:.1f} s; the top {TOP} by goodput per device "
          f"(~: estimated from its sides, not simulated whole):")
    print(f"  {'deployment':<40} {'SLO rps':>9} {'rps/device':>10} {'TTFT p90':>9} {'TPOT p90':>9}  bottleneck"
          + ("  (rps/device: per core used, the processes sharing this host's cores)" if cpu_host else ""))
    for r in [r for r in ranked if r["feasible"]][:TOP]:
        rps = f"{r['slo_rps']:.3g}" if r["slo_rps"] is not None else (
            f">={r['slo_rps_at_least']:.3g}" if r["slo_rps_at_least"] is not None else "none")
        at = r["at_slo"] or {}
        ttft = f"{at['ttft_p90_s']:.3g}s" if at.get("ttft_p90_s") is not None else "-"
        tpot = f"{at['tpot_p90_s'] * 1e3:.3g}ms" if at.get("tpot_p90_s") is not None else "-"
        name = _name(r)
        print(f"  {name:<40} {rps:>9} {('~' if r.get('estimated') else '') + format(r['goodput_per_device'], '.3g'):>10} "
              f"{ttft:>9} {tpot:>9}  {r['bottleneck'] or '-'}")
    bad = [r for r in ranked if not r["feasible"]]
    if bad:
        print(f"  not ranked: {len(bad)} (memory, or a cost model that cannot price them), e.g. "
              f"{bad[0]['name']}: {bad[0]['reason']}")
