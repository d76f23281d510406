"""``moeflow bench serve --base-url URL``: one workload run over HTTP, reported as ``vllm bench serve``.

The workload is the in-process benchmark's (``workload_config``: same kinds, seed and prompt
lengths) at ``--request-rate`` (inf: every request at t = 0, vLLM's default), capped by
``--num-prompts``. As vLLM does, one short request goes first and must succeed (a wrong URL or a
dead server fails in a second, not after the whole schedule); it also pays the server's one-time
costs outside the measurement. The result JSON holds vLLM's keys (``http_metrics``) plus the
workload and the per-request samples.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace

from moeflow.bench.http_client import HttpClientConfig, HttpRun, run_requests, token_prompts
from moeflow.bench.http_metrics import (compute_metrics, format_table, parse_goodput, parse_percentile_metrics,
                                        parse_percentiles)
from moeflow.measure.provenance import write_json
from moeflow.measure.workload import WorkloadRequest, generate_requests, workload_config

_UNUSED_OVER_HTTP = (("rps", "--rps (give one --request-rate per run)"), ("plot", "--plot (use bench plot)"),
                     ("find_slo_rps", "--find-slo-rps"), ("trace", "--trace"))


def run_http(args: argparse.Namespace) -> int:
    for name, flag in _UNUSED_OVER_HTTP:
        if getattr(args, name):
            raise ValueError(f"{flag} is not available with --base-url")
    rate = math.inf if args.request_rate is None else args.request_rate
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    if math.isinf(rate) and args.num_prompts is None and args.workload != "trace":
        raise ValueError("--request-rate inf (the default) needs --num-prompts")
    metrics_names = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    cfg = HttpClientConfig(args.base_url, args.endpoint, args.served_model_name, args.max_concurrency, args.api_key,
                           progress=not args.no_progress)
    # an infinite rate keeps the workload's lengths (a separate seeded stream) and zeroes the arrivals
    wl = workload_config(args, None if args.workload == "trace" and math.isinf(rate) else
                         (1.0 if math.isinf(rate) else rate))
    reqs = generate_requests(wl)
    if math.isinf(rate):
        reqs = [replace(r, arrival_s=0.0) for r in reqs]
    if not reqs:
        raise ValueError("the workload has no requests (raise --duration-s or --num-prompts)")

    test = run_requests(replace(cfg, progress=False), [WorkloadRequest(0.0, 16, 2)],
                        token_prompts([WorkloadRequest(0.0, 16, 2)], args.seed + 1)).outcomes[0]
    if not test.success:
        print(f"moeflow: error: the initial test request to {cfg.url} failed: {test.error}", file=sys.stderr)
        return 1
    print(f"Traffic request rate: {rate:g}\nBurstiness factor: {args.burstiness:g}"
          + (" (Poisson process)" if args.burstiness == 1.0 else " (gamma arrivals)")
          + f"\nMaximum request concurrency: {args.max_concurrency}", flush=True)
    run = run_requests(cfg, reqs, token_prompts(reqs, args.seed))
    m = compute_metrics(run.outcomes, run.duration_s, metrics_names, percentiles, goodput)
    print(format_table(m, metrics_names, percentiles), flush=True)
    errors = [o.error for o in run.outcomes if not o.success]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
    result = result_json(args, rate, wl.to_dict(), goodput, m, run)
    paths = [args.json] if args.json else []
    if args.save_result:
        paths.append(os.path.join(args.result_dir, args.result_filename or _default_filename(args, rate)))
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_json(path, result)
    return 0 if m["completed"] else 1


def result_json(args: argparse.Namespace, rate: float, workload: dict, goodput: dict, m: dict, run: HttpRun) -> dict:
    """vLLM's saved-result layout: run settings, the metrics, then per-request samples."""
    ok = [o for o in run.outcomes if o.success]
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "moeflow", "base_url": args.base_url,
            "endpoint": args.endpoint, "model_id": args.served_model_name,
            "num_prompts": len(run.outcomes), "request_rate": rate if math.isfinite(rate) else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "goodput": goodput or None, "workload": {k: v for k, v in workload.items() if k != "rate_rps"},
            **m,
            "input_lens": [o.prompt_len for o in run.outcomes], "output_lens": [o.output_tokens for o in run.outcomes],
            "ttfts": [o.ttft_s for o in ok], "itls": [list(o.itl_s) for o in ok],
            "errors": [o.error for o in run.outcomes]}


def _default_filename(args: argparse.Namespace, rate: float) -> str:
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = os.path.basename((args.served_model_name or "server").rstrip("/"))
    return f"moeflow-{rate:g}qps{conc}-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
