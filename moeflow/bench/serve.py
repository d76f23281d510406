"""``moeflow bench serve``: TTFT vs request rate of one deployment under a replayed workload.

The deployment runs in this process (no HTTP); for every rate in ``--rps`` the workload is
generated afresh (same seed: same prompt lengths at every rate) and replayed against the wall
clock (``bench.replay``). ``--find-slo-rps`` then bisects for the SLO throughput (``bench.slo``),
each probe a fresh replay on the same deployment. Output: a table per rate, ``--json``,
``--plot``, and with ``--trace`` a Chrome trace of every measured replay (warm-up left out).

With ``--base-url`` the same workload goes over HTTP to a running ``moeflow serve`` (or any
OpenAI-compatible server) instead, with ``vllm bench serve``'s flags and metric names
(``bench.http_bench``); the deployment flags are then unused.
"""
from __future__ import annotations

import argparse
import json
import math

from moeflow.bench.metrics import format_point, summarize
from moeflow.bench.replay import random_prompts, replay
from moeflow.bench.slo import SloSearch, find_slo_rps, probe_ttft_s
from moeflow.bench.workload import KINDS, WorkloadConfig, generate_requests
from moeflow.engine.args import add_engine_args, engine_kwargs

_DEFAULT_DURATION_S = 60.0


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
    w.add_argument("--rps", default=None, metavar="R1,R2,...",
                   help="request rates to measure (default 1; trace: as recorded, or rescaled to each rate)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--duration-s", type=float, default=None,
                   help=f"arrivals per rate (default {_DEFAULT_DURATION_S:g} s; trace: all of it)")
    w.add_argument("--max-tokens", type=int, default=1, help="output tokens per request (1 = prefill only)")
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-s", type=float, default=None, help="mean-TTFT SLO (drawn on the plot)")
    s.add_argument("--find-slo-rps", action="store_true", help="bisect for the highest rate within the SLO")
    s.add_argument("--slo-probes", type=int, default=5, help="bisection probes after bracketing")
    s.add_argument("--slo-rel-tol", type=float, default=0.05, help="stop bisecting once hi/lo <= 1 + this")
    h = p.add_argument_group("HTTP client (vllm bench serve's flags; --base-url selects it)")
    h.add_argument("--base-url", default=None, metavar="URL", help="drive a running server, e.g. http://127.0.0.1:8000")
    h.add_argument("--endpoint", default="/v1/completions")
    h.add_argument("--served-model-name", default=None, help='"model" field of each request (default: none sent)')
    h.add_argument("--api-key", default=None)
    h.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (HTTP default inf: all at once); in-process: the same as --rps R")
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


def workload_config(args: argparse.Namespace, rate_rps: float | None) -> WorkloadConfig:
    duration = args.duration_s
    if duration is None and args.workload != "trace" and args.num_prompts is None:
        duration = _DEFAULT_DURATION_S
    return WorkloadConfig(kind=args.workload, rate_rps=rate_rps, burstiness=args.burstiness, duration_s=duration,
                          num_requests=args.num_prompts,
                          length_scale=args.length_scale, isl=args.isl, isl_ratio=args.isl_ratio,
                          fixed_len=args.fixed_len, trace_path=args.trace_file, output_len=args.max_tokens,
                          seed=args.seed)


def parse_rates(text: str | None, kind: str) -> list[float | None]:
    if text is None:
        return [None] if kind == "trace" else [1.0]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rps: expected comma-separated numbers, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"--rps: rates must be positive numbers, got {text!r}")
    return rates


def run(args: argparse.Namespace) -> int:
    if args.base_url is not None:
        from moeflow.bench.http_bench import run_http

        return run_http(args)
    from moeflow import LLM

    if args.request_rate is not None and args.rps is None:
        args.rps = f"{args.request_rate!r}"
    rates = parse_rates(args.rps, args.workload)
    workload_config(args, rates[0])  # invalid workload flags fail before the deployment starts
    if args.find_slo_rps and args.slo_ttft_s is None:
        raise ValueError("--find-slo-rps needs --slo-ttft-s")
    search = SloSearch(args.slo_ttft_s, args.slo_probes, args.slo_rel_tol) if args.find_slo_rps else None
    kw = engine_kwargs(args)
    with LLM(**kw) as llm:
        vocab = llm.engine.model_config.vocab_size
        _warm_up(llm, vocab, args.seed)
        if args.trace:
            llm.engine.collect_spans()  # drop the warm-up's spans (and fail now if the mode records none)
        points: dict[float, dict] = {}

        def measure(rate: float | None, stop_above: float | None = None) -> float:
            cfg = workload_config(args, rate)
            reqs = generate_requests(cfg)
            prompts = random_prompts(reqs, vocab, args.seed)
            rps = rate if rate is not None else _recorded_rate(reqs)
            res = replay(llm, reqs, prompts, label=f"{rps:g}rps", stop_above_mean_ttft_s=stop_above,
                         progress=not args.no_progress)
            p = summarize(rps, res.records, res.start_s, args.length_scale, res.num_rejected, res.num_failed,
                          res.num_aborted)
            if res.stopped_early:  # only the bound is known: the completed ones are the quick ones
                p.update(stopped_early=True, ttft_mean_s=res.mean_ttft_bound_s, ttft_p50_s=None, ttft_p90_s=None,
                         ttft_p99_s=None)
            points[rps] = p
            print(format_point(p), flush=True)
            return probe_ttft_s(p)

        for rate in rates:
            measure(rate)
        slo = None
        if search is not None:
            # NOTE: with --trace every probe runs to the end: stopping aborts work in flight, and
            # collecting spans needs an idle deployment.
            stop = None if args.trace else search.slo_ttft_s
            measured = {r: probe_ttft_s(p) for r, p in points.items()}
            slo = find_slo_rps(lambda r: measure(r, stop), search, measured)
            print(f"SLO throughput (mean TTFT <= {search.slo_ttft_s:g} s): "
                  + (f"{slo.rps:g} rps" if slo.rps is not None else "none of the probed rates meets it")
                  + (f" (misses at {slo.upper_rps:g} rps)" if slo.upper_rps is not None else " (no failing rate found)")
                  + f", {slo.num_probes} probes")
        spans = llm.engine.collect_spans() if args.trace else None
    result = {"mode": args.mode, "config": kw,
              "workload": {k: v for k, v in workload_config(args, None if args.workload == "trace" else 1.0)
                           .to_dict().items() if k != "rate_rps"},
              "slo_ttft_s": args.slo_ttft_s, "slo_rps": slo.rps if slo is not None else None,
              "slo_upper_rps": slo.upper_rps if slo is not None else None,
              "points": [points[r] for r in sorted(points)]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from moeflow.bench.plot import plot_results

        plot_results([result], args.plot)
    if spans is not None:
        from moeflow.engine.trace import write_chrome_trace

        write_chrome_trace(spans, args.trace)
    return 0


def _warm_up(llm, vocab: int, seed: int) -> None:
    """A few short prompts first: the first batches pay one-time costs (allocation, lazy init)."""
    from moeflow import SamplingParams
    from moeflow.bench.workload import WorkloadRequest

    reqs = [WorkloadRequest(0.0, 16, 1)] * 4
    llm.generate(random_prompts(reqs, vocab, seed + 1), SamplingParams(max_tokens=1, temperature=0.0))


def _recorded_rate(reqs) -> float:
    """Mean arrival rate of a trace replayed as recorded."""
    if len(reqs) < 2 or reqs[-1].arrival_s <= reqs[0].arrival_s:
        return float(len(reqs))
    return (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)
