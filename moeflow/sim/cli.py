"""``moeflow simulate``: run an experiment config through the simulator.

Prints each system's TTFT table per rate, the SLO throughput of each and their ratios, and the
simulator's speed; writes the ``bench serve`` JSON schema (``{"systems": {...}}`` when the config
has several) without the per-request TTFTs unless ``--raw`` (the simulator is deterministic: the
config and commit regenerate them), a TTFT-vs-rate plot and a Chrome trace of one rate's timelines.
"""
from __future__ import annotations

import argparse
import json
import time

from moeflow.measure.provenance import provenance, write_json
from moeflow.measure.rate_flag import add_request_rate
from moeflow.measure.workload import rates_of


def modelled(sim, cost) -> str:
    """What a system's run models that the engine does not choose: the attention split, the jitter
    and skew it draws (their values, resolved from the hardware and the model where not set)."""
    jitter = cost.compute_jitter_cv if sim.compute_jitter_cv is None else sim.compute_jitter_cv
    skew = cost.model.gate_load_cv if sim.expert_load_cv is None else sim.expert_load_cv
    return f"attention groups split {sim.attention_parallel}, compute jitter CV {jitter:g}, expert skew CV {skew:g}"


# dep's step split (sim/dep.py) as the output names it: the barrier wait includes jitter and skew
SPLIT_NAMES = {"attention": "compute (attention)", "ffn": "compute (experts)", "transport": "all-to-all",
               "wait": "barrier wait"}


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of a deployment (configs/*.yaml)")
    p.add_argument("--config", required=True, metavar="FILE.yaml")
    p.add_argument("--system", action="append", default=None, metavar="NAME",
                   help="simulate only these systems of the config (repeatable)")
    add_request_rate(p, "rates to simulate (req/s), comma-separated (default: the config's)")
    p.add_argument("--find-slo-rps", action="store_true", help="bisect for the SLO throughput (also: config)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.add_argument("--raw", action="store_true",
                   help="keep every request's TTFT in --json (by default the result is a summary without them)")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="Chrome trace of one rate (--trace-rps)")
    p.add_argument("--trace-rps", type=float, default=None, help="rate to trace (default: the first)")
    p.add_argument("--trace-window-s", type=float, default=10.0, help="simulated seconds the trace covers")
    p.add_argument("--compare", action="append", default=[], metavar="SYSTEM=MEASURED.json",
                   help="print the mean-TTFT and SLO-throughput error against a `bench serve` result (repeatable)")
    p.add_argument("--compare-with", default=None, metavar="RESULT.json",
                   help="a `bench compare` result of this same experiment: simulate its rates and seeds, and "
                        "report the error per point and system against its measured means and intervals")
    p.add_argument("--repeats", type=int, default=1, help="seeds seed, seed+1, ... (as bench compare runs them)")
    p.add_argument("--slo-metric", default=None, metavar="M[,M...]|all",
                   help="what meets the SLO, as in bench serve (mean, p50, p90, p99, attainment:F); several, "
                        "comma-separated, or all: the search runs for each (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override the config: KEY (top level), workload.KEY, sim.KEY for every system, or "
                        "systems.NAME.KEY (repeatable; VALUE read as YAML), e.g. --set sim.expert_load_cv=0.5")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    with open(args.config) as f:
        raw = yaml.safe_load(f) or {}
    if "contexts" in raw:  # a `bench decode` file: steady-state decode
        return _run_decode(args)
    if "e2e" in raw:  # a disaggregated Pareto, rate-matched
        return _run_e2e(args, raw)
    from moeflow.measure.metrics import format_point, without_raw
    from moeflow.experiment.serve import load_experiment as load_config
    from moeflow.sim.run import build_cost, run_system

    cfg = load_config(args.config, tuple(args.set))
    metrics = slo_metrics(args.slo_metric or cfg.slo_metric)
    names = args.system or list(cfg.systems)
    unknown = [n for n in names if n not in cfg.systems]
    if unknown:
        raise ValueError(f"--system {unknown}: the config has {list(cfg.systems)}")
    rates = {n: tuple(rates_of(args.request_rate)) if args.request_rate else cfg.rates(n) for n in names}
    measured = None
    if args.compare_with:
        with open(args.compare_with) as f:
            measured = json.load(f)
        names = [n for n in names if n in measured["systems"]]
        if not names:
            raise ValueError(f"--compare-with {args.compare_with}: none of its systems "
                             f"{sorted(measured['systems'])} is in the config")
        rates = {n: tuple(sorted({p["rps"] for p in measured["systems"][n]["points"]})) for n in names}
        args.repeats = measured.get("repeats", args.repeats)
    find_slo = args.find_slo_rps or cfg.find_slo_rps
    if find_slo and not cfg.slo_ttft_s:
        raise ValueError("--find-slo-rps needs slo_ttft_s in the config")
    trace_rate = (args.trace_rps or rates[names[0]][0]) if args.trace else None
    from moeflow.sim import symmetry

    print(symmetry.report(symmetry.differences({n: cfg.systems[n] for n in names})))
    cost = build_cost(cfg)
    out: dict[str, dict] = {}
    spans = []
    for name in names if any(rates.values()) or find_slo else ():
        t0 = time.perf_counter()
        res = run_system(name, cfg, cost, rates[name], find_slo, trace_rate, args.trace_window_s, args.repeats, metrics)
        wall = time.perf_counter() - t0
        res.result["sim_speed"] = {"events": res.num_events, "wall_s": wall, "events_per_s": res.num_events / wall}
        out[name] = res.result
        spans += [type(s)(s.name, f"{name}:{s.track}", s.start_s, s.end_s) for s in res.spans]
        print(f"== {name} ({res.result['config']['devices']} devices, {cfg.model} on {cfg.target.hardware}, "
              f"{cfg.target.cost} cost; {modelled(cfg.systems[name].sim, cost)})")
        # with repeats, each seed's runs (the averaged points lack a run's counts and busy split)
        for rep in res.result.get("repeats") or [{"seed": None, "sweep": res.result["points"], "probes": []}]:
            for p in rep["sweep"] + rep["probes"]:
                print(("" if rep["seed"] is None else f"[seed {rep['seed']}] ") + format_point(p))
                print("  busy (computing, not waiting): "
                      + ", ".join(f"{role} {frac:.0%}" for role, frac in p["sim_busy"].items())
                      + (f"; expert load, most loaded device / mean: {p['sim_expert_imbalance']:.2f}"
                         if "sim_expert_imbalance" in p else ""))
                if "sim_split" in p:
                    print("  a rank's time: " + ", ".join(f"{SPLIT_NAMES.get(k, k)} {v:.0%}"
                                                          for k, v in p["sim_split"].items()))
                if "goodput_per_process_s" in p:
                    print(f"  goodput {p['goodput_rps']:.3g} rps ({p['slo_attainment']:.0%} of requests within both "
                          f"SLOs); {p['process_s']:,.0f} process-seconds: {p['goodput_per_process_s']:.4g} good "
                          f"requests per process-second")
                for c in p.get("membership_changes", []):
                    done = "not done by the end" if c["done_s"] is None else f"serving at {c['done_s']:.1f} s"
                    print(f"  at {c['asked_s']:.1f} s {c['side']} {c['before']} -> {c['after']} ({c['reason']}): {done}")
        print(f"simulated {res.num_events:,} events in {wall:.1f} s ({res.num_events / wall:,.0f} events/s)")
    if find_slo:
        print_slo_table(out, names, metrics, cfg.slo_ttft_s)
    comparisons = {}
    if measured is not None:
        from moeflow.sim.compare import compare, format_comparison

        for name in names:
            if name in out:  # systems with rates; saturation-only ones are compared below
                comparisons[name] = compare(out[name], measured["systems"][name])
                print(format_comparison(name, comparisons[name], comparisons[name]["measured_slo_rps"]))
        for name, c in _saturation_comparisons(cfg, cost, names, measured, args.repeats).items():
            comparisons[name] = {**comparisons.get(name, {}), **c}
    for spec in args.compare:
        from moeflow.sim.compare import compare, format_comparison

        name, _, path = spec.partition("=")
        if name not in out or not path:
            raise ValueError(f"--compare {spec!r}: want SYSTEM=FILE.json with SYSTEM among {names}")
        with open(path) as f:
            comparisons[name] = compare(out[name], json.load(f))
        print(format_comparison(name, comparisons[name], comparisons[name]["measured_slo_rps"]))
    data = {} if not out else out[names[0]] if len(names) == 1 else {"systems": out}
    if cfg.sweeps or cfg.roofline_isl:
        from moeflow.sim.sweep import run_roofline, run_sweeps

        if cfg.roofline_isl:
            data["roofline"] = run_roofline(cfg, cost, names)
        if cfg.sweeps:
            data["sweeps"] = run_sweeps(cfg, cost, names)
    if comparisons:
        data = {**data, "comparison": comparisons} if "systems" in data else {"systems": out, "comparison": comparisons}
    if args.json:
        write_json(args.json, data if args.raw else without_raw(data))
    if args.plot and out:
        from moeflow.measure.plot import plot_results

        plot_results(list(out.values()), args.plot)
    if args.trace:
        from moeflow.engine.trace import write_chrome_trace

        if not spans:
            raise ValueError(f"nothing ran in the first {args.trace_window_s:g} simulated s at {trace_rate:g} rps: "
                             "raise --trace-window-s")
        write_chrome_trace(spans, args.trace, {"provenance": provenance()})
    return 0


def _saturation_comparisons(cfg, cost, names: list[str], measured: dict, repeats: int) -> dict:
    """Each measured saturation run simulated once per seed it was measured with, at the rate and
    with the requests its probe ended on (the saturation probe raises the rate per repeat)."""
    from moeflow.sim.compare import compare_saturation, format_saturation
    from moeflow.sim.run import run_point

    out = {}
    for name in names:
        sat = measured["systems"][name].get("saturation")
        if not sat:
            continue
        reps = measured["systems"][name].get("repeats", [])
        # the raising probe offers its first probe's request count at every rate, which the rate
        # alone does not give; a fixed-rate probe (older results) is simulated as it always was
        runs = [(r["seed"], r["saturation"]["rps"], r["saturation"]["num_requests"] if "saturated" in r["saturation"]
                 else None) for r in reps if r.get("saturation")]
        runs = runs or [(seed, sat["rps"], None) for seed in [r["seed"] for r in reps]
                        or [cfg.workload.seed + k for k in range(repeats)]]
        tok_s = [run_point(cfg.systems[name], cost, cfg, rate, seed, num_requests=n)[0]["prefill_tok_s"]
                 for seed, rate, n in runs]
        c = compare_saturation(tok_s, measured["systems"][name])
        out[name] = {"saturation": c}
        print(format_saturation(name, c))
    return out


def slo_metrics(text: str) -> tuple:
    """``mean``, ``p90,p99``, ``all`` (mean, p50, p90, p99, attainment:0.95) -> SloMetrics."""
    from moeflow.measure.slo import ALL_METRICS, SloMetric

    if text == "all":
        return ALL_METRICS
    return tuple(dict.fromkeys(SloMetric.parse(t.strip()) for t in text.split(",")))


def print_slo_table(out: dict, names: list[str], metrics: tuple, slo_s: float) -> None:
    """SLO throughput of every system under every searched metric (``>= X``: no rate up to the
    search's cap missed it), then each ratio a / b > 1 of known values."""
    from moeflow.measure.slo import format_slo

    print(f"\nSLO throughput (rps; TTFT <= {slo_s:g} s under each metric):")
    print(f"  {'':>24}" + "".join(f"{m.name:>16}" for m in metrics))
    for name in names:
        by = out[name]["slo_rps_by_metric"]
        print(f"  {name:>24}" + "".join(f"{format_slo(by[m.name]['median'], by[m.name].get('median_at_least')):>16}"
                                        for m in metrics))
    for a in names:
        for b in names:
            ra = [out[a]["slo_rps_by_metric"][m.name]["median"] for m in metrics]
            rb = [out[b]["slo_rps_by_metric"][m.name]["median"] for m in metrics]
            if a != b and ra[0] and rb[0] and ra[0] > rb[0]:
                print(f"  {a + ' / ' + b:>24}" + "".join(
                    f"{(x / y if x and y else float('nan')):>16.2f}" for x, y in zip(ra, rb)))


def _run_e2e(args: argparse.Namespace, raw: dict) -> int:
    from moeflow.experiment.e2e import parse_e2e
    from moeflow.experiment.serve import apply_overrides
    from moeflow.sim.e2e import format_e2e, run_e2e
    from moeflow.sim.run import build_cost

    for flag in ("system", "request_rate", "find_slo_rps", "trace", "compare", "compare_with", "slo_metric"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')}: not for an end-to-end file ({args.config} has e2e:)")
    x = parse_e2e(apply_overrides(raw, tuple(args.set)))
    t0 = time.perf_counter()
    result = run_e2e(x, build_cost(x.experiment))
    print(format_e2e(x, result))
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    if args.json:
        write_json(args.json, {"config": args.config, **result, "provenance": provenance()})
    if args.plot:
        from moeflow.measure.plot import plot_fronts

        plot_fronts(result["fronts"], args.plot, "TPS/user", "output TPS/device")
    return 0


def _run_decode(args: argparse.Namespace) -> int:
    from moeflow.sim.decode import run_decode

    for flag in ("request_rate", "find_slo_rps", "plot", "trace", "slo_metric", "set"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')}: not for a decode file ({args.config} has contexts:)")
    measured = None
    if args.compare_with:
        with open(args.compare_with) as f:
            measured = json.load(f)
    data = run_decode(args.config, args.system, measured)
    if args.json:
        write_json(args.json, data)
    return 0
