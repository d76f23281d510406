"""``moeflow bench serve``: TTFT vs request rate of one deployment under a replayed workload.

The deployment runs in this process (no HTTP); for every rate of ``--request-rate`` the workload is
generated afresh (same seed: same prompt lengths at every rate) and replayed against the wall
clock (``bench.replay``). ``--find-slo-rps`` then bisects for the SLO throughput (``measure.slo``),
each probe a fresh replay on the same deployment. Output: a table per rate, ``--json``,
``--plot``, and with ``--trace`` a Chrome trace of every measured replay (warm-up left out).

With ``--base-url`` the same workload goes over HTTP to a running ``moeflow serve`` (or any
OpenAI-compatible server) instead, with ``vllm bench serve``'s flags and metric names
(``bench.http_bench``); the deployment flags are then unused.
"""
from __future__ import annotations

import argparse

from moeflow.engine.args import add_engine_args, engine_kwargs
from moeflow.measure.metrics import format_point
from moeflow.measure.provenance import provenance, write_json
from moeflow.measure.slo import METRICS, SloMetric, SloSearch
from moeflow.measure.workload import DEFAULT_DURATION_S, KINDS, parse_rates, workload_config


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="replay a workload at given rates: TTFT vs rate, SLO throughput")
    add_engine_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="production", choices=KINDS)
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply every prompt length (min 1 token)")
    w.add_argument("--isl", type=int, default=4096, help="uniform: longest prompt")
    w.add_argument("--isl-ratio", type=float, default=0.5, help="uniform: shortest prompt = ratio * isl")
    w.add_argument("--fixed-len", type=int, default=1024, help="fixed: prompt length")
    w.add_argument("--trace-file", default=None, metavar="FILE.jsonl",
                   help="trace workload: arrival_s, prompt_len[, output_len] per line")
    w.add_argument("--request-rate", default=None, metavar="R[,R...]",
                   help="requests/s. In-process: the rates to measure, comma-separated (default 1; trace: as "
                        "recorded, or rescaled to each rate). HTTP: one rate (default inf: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--duration-s", type=float, default=None,
                   help=f"arrivals per rate (default {DEFAULT_DURATION_S:g} s; trace: all of it)")
    w.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = prefill only)")
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-s", type=float, default=None, help="TTFT SLO in seconds (drawn on the plot)")
    s.add_argument("--slo-metric", default="mean", metavar="|".join(METRICS),
                   help="what meets the SLO: mean TTFT, a nearest-rank percentile over all requests, or "
                        "attainment:F = at least a fraction F of requests within it (vLLM's goodput)")
    s.add_argument("--find-slo-rps", action="store_true", help="bisect for the highest rate within the SLO")
    s.add_argument("--slo-probes", type=int, default=5, help="bisection probes after bracketing")
    s.add_argument("--slo-rel-tol", type=float, default=0.05, help="stop bisecting once hi/lo <= 1 + this")
    h = p.add_argument_group("HTTP client (vllm bench serve's flags; --base-url selects it)")
    h.add_argument("--base-url", default=None, metavar="URL", help="drive a running server, e.g. http://127.0.0.1:8000")
    h.add_argument("--endpoint", default="/v1/completions")
    h.add_argument("--served-model-name", default=None, help='"model" field of each request (default: none sent)')
    h.add_argument("--api-key", default=None)
    h.add_argument("--num-prompts", type=int, default=None, help="at most this many requests (instead of --duration-s)")
    h.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (HTTP)")
    h.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for request_goodput, NAME in ttft, tpot, e2el (milliseconds)")
    h.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft, tpot, itl, e2el")
    h.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    h.add_argument("--save-result", action="store_true", help="write the result JSON to --result-dir")
    h.add_argument("--result-dir", default=".")
    h.add_argument("--result-filename", default=None)
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE.json")
    o.add_argument("--plot", default=None, metavar="FILE.png")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.base_url is not None:
        from moeflow.bench.http_bench import run_http

        return run_http(args)
    from moeflow import LLM
    from moeflow.bench.probe import Prober, slo_table

    rates = parse_rates(args.request_rate, args.workload)
    workload_config(args, rates[0])  # invalid workload flags fail before the deployment starts
    if args.find_slo_rps and args.slo_ttft_s is None:
        raise ValueError("--find-slo-rps needs --slo-ttft-s")
    metric = SloMetric.parse(args.slo_metric)
    search = SloSearch(args.slo_ttft_s, args.slo_probes, args.slo_rel_tol, metric=metric) if args.find_slo_rps else None
    kw = engine_kwargs(args)
    with LLM(**kw) as llm:
        prober = Prober(llm, lambda rate: workload_config(args, rate), args.seed, progress=not args.no_progress)
        prober.warm_up()
        if args.trace:
            llm.engine.collect_spans()  # drop the warm-up's spans (and fail now if the mode records none)
        for rate in rates:
            print(format_point(prober.measure(rate)), flush=True)
        slo = None
        if search is not None:
            # NOTE: with --trace every probe runs to the end: collecting spans needs the whole run
            slo = prober.find_slo(search, early_stop=not args.trace)
            for r in sorted(prober.points):
                if r not in rates:
                    print(format_point(prober.points[r]), flush=True)
            print(f"SLO throughput ({metric.name} TTFT <= {search.slo_ttft_s:g} s): {slo.describe()}, "
                  f"{slo.num_probes} probes")
        spans = llm.engine.collect_spans() if args.trace else None
        config = {**kw, "dtype": llm.config.dtype}
    points = [prober.points[r] for r in sorted(prober.points)]
    result = {"mode": args.mode, "config": config,
              "workload": {k: v for k, v in workload_config(args, None if args.workload == "trace" else 1.0)
                           .to_dict().items() if k != "rate_rps"},
              "slo_ttft_s": args.slo_ttft_s, "slo_metric": metric.name, "slo_rps": slo.rps if slo is not None else None,
              "slo_upper_rps": slo.upper_rps if slo is not None else None,
              "slo_rps_at_least": slo.at_least_rps if slo is not None else None,  # unbracketed: a bound only
              "slo_rps_by_metric": slo_table(points, args.slo_ttft_s),
              "points": points}
    if args.json:
        write_json(args.json, result)
    if args.plot:
        from moeflow.measure.plot import plot_results

        plot_results([result], args.plot)
    if spans is not None:
        from moeflow.engine.trace import write_chrome_trace

        write_chrome_trace(spans, args.trace, {"provenance": provenance()})
    return 0
