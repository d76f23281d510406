"""``moeflow bench compare CONFIG.yaml``: every system of an experiment file on the real engine,
side by side, repeated, with intervals — the comparison a benchmark team would trust.

One deployment per system (``LLM.from_system``: the same ``systems:`` entry ``moeflow simulate``
reads), all started up front and idle between their probes. ``repeats`` times, with seeds s, s+1,
...: at every rate of the sweep the systems run one after another in rotated order (A B C, then
B C A, ...) so slow drift of a shared machine hits them alike; then, per repeat, each system's
SLO search (probes stopped early once they certainly miss, and drained so the next probe starts
idle) and its saturation probe (``measure.saturation``: from ``saturation_rps``, the offered rate
doubled until prefill tokens/s stops growing, or "not saturated at X rps"; traced for the time
split). Writes one JSON (``bench serve``'s schema per system, points averaged over repeats with
95% intervals, every repeat kept) and a Markdown report (``compare_report``).

``--merge A.json B.json`` combines runs of the same experiment (e.g. systems measured in two
sittings) and refuses results of different commits unless ``--allow-mixed``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from moeflow.measure import compare_report as report
from moeflow.measure.metrics import format_point
from moeflow.measure.provenance import provenance, write_json
from moeflow.measure.rate_flag import add_request_rate
from moeflow.measure.slo import ALL_METRICS, SloMetric, SloSearch, slo_rps_from_points
from moeflow.measure.workload import rates_of


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="every system of an experiment file on the real engine: repeats, "
                                       "intervals, ratios, SLO throughput under every metric, capacity")
    p.add_argument("config", nargs="?", metavar="CONFIG.yaml")
    p.add_argument("--repeats", type=int, default=None, help="sweeps with seeds s, s+1, ... (default: the config's, 3)")
    p.add_argument("--system", action="append", default=None, metavar="NAME", help="only these systems (repeatable)")
    add_request_rate(p, "rates of the sweep (req/s), comma-separated (default: the config's)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per point (default: enough for "
                                                                   "min_requests at every rate)")
    p.add_argument("--find-slo-rps", action="store_true", help="per repeat and system, bisect for the SLO throughput")
    p.add_argument("--slo-metric", default=None, help="the metric the search bisects on (default: the config's)")
    p.add_argument("--profile", default=None, help="moeflow profile JSON for the capacity (default: the config's)")
    p.add_argument("--saturation-rps", type=float, default=None,
                   help="first offered rate of the saturation probe (doubled until throughput stops growing)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.add_argument("--md", default=None, metavar="OUT.md")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULT.json", help="combine earlier results")
    p.add_argument("--allow-mixed", action="store_true", help="--merge results of different commits")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return _merge(args)
    if not args.config:
        raise ValueError("bench compare: give CONFIG.yaml (or --merge RESULT.json ...)")
    from moeflow.experiment.serve import load_experiment

    exp = load_experiment(args.config)
    names = args.system or list(exp.systems)
    missing = [n for n in names if n not in exp.systems]
    if missing:
        raise ValueError(f"--system {missing}: the config has {list(exp.systems)}")
    # per system: the file may give each its own rates (as many each); the flag sets every system's
    rates = {n: rates_of(args.request_rate) if args.request_rate else list(exp.rates(n)) for n in names}
    repeats = args.repeats or exp.repeats
    metric = SloMetric.parse(args.slo_metric or exp.slo_metric)
    find_slo = args.find_slo_rps or exp.find_slo_rps
    sat_rps = args.saturation_rps or exp.saturation_rps
    if find_slo and not exp.slo_ttft_s:
        raise ValueError("--find-slo-rps needs slo_ttft_s in the config")
    profile = args.profile or exp.target.profile
    if profile:  # NOTE: read now, not after an hour of measuring (the capacity needs it at the end)
        from moeflow.measure.capacity import load_profile
        if not os.path.exists(profile):
            raise FileNotFoundError(f"the profile {profile!r} (the config's profile:, for the capacity fraction) does "
                                    f"not exist: run `moeflow profile --model {exp.model} --json {profile}` first, "
                                    f"or give --profile")
        load_profile(profile)
    t0 = time.monotonic()
    # NOTE: read at launch: the code that runs is the tree as it is now, whatever is edited meanwhile
    prov = provenance()
    runs = {n: {"repeats": [{"seed": exp.workload.seed + k, "sweep": [], "probes": []} for k in range(repeats)]}
            for n in names}
    try:
        _measure(exp, names, rates, repeats, metric, find_slo, sat_rps, args, runs)
    except BaseException:  # what was measured outlives the failure (an hour's run of points)
        if args.json:
            write_json(args.json + ".partial.json", {"runs": runs, "provenance": prov})
            print(f"bench compare: stopped; the points measured so far are in {args.json}.partial.json", flush=True)
        raise
    try:
        result = _assemble(exp, names, runs, repeats, metric, profile, args.config, prov)
    except Exception:  # the measurements outlive a bug in the summary: kept next to the result
        if args.json:
            write_json(args.json + ".raw.json", {"runs": runs})
            print(f"bench compare: summarizing failed; the raw runs are in {args.json}.raw.json", flush=True)
        raise
    result["wall_s"] = time.monotonic() - t0
    _write(result, args)
    return 0


def _measure(exp, names, rates, repeats, metric, find_slo, sat_rps, args, runs: dict) -> None:
    """Fills ``runs`` (per system, its repeats' points) as it measures."""
    from moeflow import LLM
    from moeflow.bench.probe import Prober
    from moeflow.engine.eplb_report import summary as eplb_summary

    seed0 = exp.workload.seed
    llms = {}
    try:
        for n in names:  # every deployment up front; idle ones wait on pipes and doorbells
            spec = exp.systems[n]
            llms[n] = LLM.from_system(dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, trace=True)))
            runs[n]["dtype"] = llms[n].config.dtype
            print(f"{n}: {spec.layout.describe()} up ({llms[n].config.dtype})", flush=True)
        probers = {n: [Prober(llms[n], lambda rate, k=k: exp.point_workload(rate, seed0 + k, args.num_requests),
                              seed0 + k, progress=not args.no_progress, slo=exp.goodput_slo)
                       for k in range(repeats)] for n in names}
        for n in names:
            probers[n][0].warm_up()
        _drop_spans(llms)
        num_rates = len(rates[names[0]])
        for k in range(repeats):
            for i in range(num_rates):
                shift = (k * num_rates + i) % len(names)
                for n in names[shift:] + names[:shift]:
                    rate = rates[n][i]
                    p = probers[n][k].measure(rate, label=f"{n} r{k} {rate:g}rps")
                    runs[n]["repeats"][k]["sweep"].append(p)
                    print(f"[repeat {k}] {n}\n{format_point(p)}", flush=True)
                    _drop_spans({n: llms[n]})
            for j, n in enumerate(names[k % len(names):] + names[:k % len(names)]):
                pr, rep = probers[n][k], runs[n]["repeats"][k]
                if find_slo:
                    res = pr.find_slo(SloSearch(exp.slo_ttft_s, exp.slo_probes, exp.slo_rel_tol, metric=metric))
                    rep["search"] = dataclasses.asdict(res)
                    print(f"[repeat {k}] {n}: SLO throughput ({metric.name}) {res.describe()}", flush=True)
                    _drop_spans({n: llms[n]})
                rep["probes"] = [p for r, p in sorted(pr.points.items()) if r not in rates[n]]
                if sat_rps:
                    sat = _saturation(exp, llms[n], seed0 + k, sat_rps, args, label=f"{n} r{k} saturation")
                    rep["saturation"] = sat.to_point()
                    print(f"[repeat {k}] {n}: {sat.describe()}", flush=True)
    finally:
        for n, llm in llms.items():
            runs[n]["eplb"] = eplb_summary(getattr(llm.engine, "eplb", None))
            llm.shutdown()
    for n in names:
        for rep in runs[n]["repeats"]:
            points = rep["sweep"] + rep["probes"]
            rep["slo"] = {m.name: dataclasses.asdict(slo_rps_from_points(points, m, exp.slo_ttft_s))
                          for m in ALL_METRICS} if exp.slo_ttft_s else {}


def _saturation(exp, llm, seed: int, start_rps: float, args, label: str):
    """The saturation probe (``measure.saturation``): the same requests offered at rising rates
    until throughput stops growing, each probe with the time split of its steady middle."""
    from moeflow.measure.capacity import steady_window, thread_busy, time_split
    from moeflow.bench.probe import Prober
    from moeflow.measure.saturation import SaturationSearch, find_saturation
    from moeflow.measure.workload import generate_requests
    from moeflow.engine.base import clock

    num = len(generate_requests(exp.point_workload(start_rps, seed, args.num_requests)))
    prober = Prober(llm, lambda rate: exp.point_workload(rate, seed, num), seed, progress=not args.no_progress)

    def probe(rate: float) -> dict:
        _spans(llm)  # drop what came before
        t0 = clock()
        p = prober.measure(rate, label=f"{label} {rate:g}rps")
        spans = _spans(llm)
        window = steady_window(spans, t0, clock())  # the middle 80% of this run's spans
        if window is not None:
            p["time_split"] = time_split(spans, *window)
            copy = thread_busy(spans, *window, thread="copy")
            if copy:
                p["copy_busy"] = copy
        return p

    return find_saturation(probe, SaturationSearch(start_rps))


def _spans(llm) -> list:
    try:
        return llm.engine.collect_spans()
    except ValueError:  # a mode without worker processes records none
        return []


def _drop_spans(llms: dict) -> None:
    for llm in llms.values():
        _spans(llm)


def _assemble(exp, names, runs, repeats, metric, profile_path, config_path, prov: dict) -> dict:
    from moeflow.measure.capacity import capacity_tok_s, load_profile
    from moeflow.experiment.system import system_to_dict

    capacity = None
    if profile_path:
        capacity = capacity_tok_s(load_profile(profile_path), exp.workload, prov["cores"])
        capacity["profile"] = profile_path
    systems = {}
    for n in names:
        reps = runs[n]["repeats"]
        slo = report.slo_by_metric(reps)
        systems[n] = {"mode": exp.systems[n].layout.mode,
                      "config": {"name": n, **system_to_dict(exp.systems[n]), "model": exp.model, "dtype": runs[n]["dtype"]},
                      "workload": {k: v for k, v in exp.workload.to_dict().items() if k != "rate_rps"},
                      "slo_ttft_s": exp.slo_ttft_s, "slo_metric": metric.name,
                      "slo_rps": slo[metric.name]["median"], "slo_rps_at_least": slo[metric.name]["median_at_least"],
                      "slo_rps_by_metric": slo,
                      "points": report.aggregate_points(reps), "repeats": reps,
                      "saturation": report.saturation_summary(reps, capacity["tok_s"] if capacity else None),
                      "eplb": runs[n].get("eplb")}
    pairs = exp.compare or tuple((n, names[0]) for n in names[1:])
    comparisons = [report.comparison(a, systems[a], b, systems[b], metric.name) for a, b in pairs
                   if a in systems and b in systems]
    return {"title": exp.title, "experiment": os.path.relpath(config_path), "dtype": runs[names[0]]["dtype"],
            "repeats": repeats, "seeds": [exp.workload.seed + k for k in range(repeats)],
            "slo_ttft_s": exp.slo_ttft_s, "slo_tpot_s": exp.slo_tpot_s, "slo_metric": metric.name,
            "capacity": capacity,
            "systems": systems, "comparisons": comparisons, "provenance": prov}


def _write(result: dict, args) -> None:
    if args.json:
        write_json(args.json, result)
    md = report.markdown(result)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")
    print(md)


def _merge(args) -> int:
    results = []
    for path in args.merge:
        with open(path) as f:
            results.append(json.load(f))
    commits = {r["provenance"]["commit"] + ("+dirty" if r["provenance"].get("dirty") else "") for r in results}
    if len(commits) > 1 and not args.allow_mixed:
        which = ", ".join(f"{p}: {r['provenance']['commit'][:10]}" for p, r in zip(args.merge, results))
        raise ValueError(f"--merge: the results come from different commits {sorted(commits)} ({which}); "
                         f"re-measure on one commit, or pass --allow-mixed")
    out = dict(results[0])
    out["systems"] = {}
    for r in results:
        out["systems"].update(r["systems"])
    out["merged_from"] = [{"file": p, "commit": r["provenance"]["commit"]} for p, r in zip(args.merge, results)]
    out["provenance"] = {**results[0]["provenance"], "command": provenance()["command"],
                         "commit": results[0]["provenance"]["commit"] if len(commits) == 1 else "mixed: " + ", ".join(sorted(commits))}
    pairs = list(dict.fromkeys((c["a"], c["b"]) for r in results for c in r.get("comparisons", [])))
    out["comparisons"] = [report.comparison(a, out["systems"][a], b, out["systems"][b], out["slo_metric"])
                          for a, b in pairs if a in out["systems"] and b in out["systems"]]
    _write(out, args)
    return 0
