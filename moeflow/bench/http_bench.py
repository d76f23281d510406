"""``moeflow bench serve --base-url URL``: one workload run over HTTP, reported as ``vllm bench serve``.

The workload is the in-process benchmark's (``workload_config``: same kinds, seed and prompt
lengths) at ``--request-rate`` (inf: every request at t = 0, vLLM's default), capped by
``--num-prompts``. As vLLM does, one short request goes first and must succeed (a wrong URL or a
dead server fails in a second, not after the whole schedule); it also pays the server's one-time
costs outside the measurement. The result JSON holds vLLM's keys (``http_metrics``) plus the
workload and the per-request samples. ``bench_http`` is the run itself (the demo calls it);
``run_http`` reads the flags and writes the files.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TextIO

from moeflow.bench.http_client import HttpClientConfig, HttpRun, run_requests, token_prompts
from moeflow.bench.http_metrics import (compute_metrics, format_table, parse_goodput, parse_percentile_metrics,
                                        parse_percentiles)
from moeflow.measure.provenance import write_json
from moeflow.measure.workload import WorkloadConfig, WorkloadRequest, generate_requests, workload_config

_UNUSED_OVER_HTTP = (("plot", "--plot (use bench plot)"), ("find_slo_rps", "--find-slo-rps"), ("trace", "--trace"))


class ServerUnavailable(RuntimeError):
    """The initial test request failed: nothing of the workload was sent."""


@dataclass(frozen=True)
class HttpBench:
    """One run: which server, what workload at what rate, which metrics to report."""

    client: HttpClientConfig
    workload: WorkloadConfig  # lengths and seed; its arrivals are used unless the rate is inf
    rate: float = math.inf  # requests/s, as recorded in the result; inf: every request at t = 0
    metric_names: tuple[str, ...] = ("ttft", "tpot", "itl")  # of ttft, tpot, itl, e2el
    percentiles: tuple[float, ...] = (99.0,)
    goodput_ms: dict[str, float] = field(default_factory=dict)  # SLOs of request_goodput (empty: none)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.rate}")


def bench_http(b: HttpBench, out: TextIO = sys.stdout) -> dict:
    """Send the test request, then the workload; print vLLM's table to ``out``; return the result
    (vLLM's saved-result layout). Raises ``ServerUnavailable`` when the test request fails."""
    reqs = generate_requests(b.workload)
    if math.isinf(b.rate):
        reqs = [replace(r, arrival_s=0.0) for r in reqs]
    if not reqs:
        raise ValueError("the workload has no requests (raise --duration-s or --num-prompts)")
    probe = [WorkloadRequest(0.0, 16, 2)]
    test = run_requests(replace(b.client, progress=False), probe, token_prompts(probe, b.workload.seed + 1)).outcomes[0]
    if not test.success:
        raise ServerUnavailable(f"the initial test request to {b.client.url} failed: {test.error}")
    burst = b.workload.burstiness
    print(f"Traffic request rate: {b.rate:g}\nBurstiness factor: {burst:g}"
          + (" (Poisson process)" if burst == 1.0 else " (gamma arrivals)")
          + f"\nMaximum request concurrency: {b.client.max_concurrency}", file=out, flush=True)
    run = run_requests(b.client, reqs, token_prompts(reqs, b.workload.seed))
    m = compute_metrics(run.outcomes, run.duration_s, b.metric_names, b.percentiles, b.goodput_ms)
    print(format_table(m, b.metric_names, b.percentiles), file=out, flush=True)
    errors = [o.error for o in run.outcomes if not o.success]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
    return result_json(b, m, run)


def run_http(args: argparse.Namespace) -> int:
    for name, flag in _UNUSED_OVER_HTTP:
        if getattr(args, name):
            raise ValueError(f"{flag} is not available with --base-url")
    rate = _one_rate(args.request_rate)
    if math.isinf(rate) and args.num_prompts is None and args.workload != "trace":
        raise ValueError("--request-rate inf (the default) needs --num-prompts")
    client = HttpClientConfig(args.base_url, args.endpoint, args.served_model_name, args.max_concurrency,
                              args.api_key, progress=not args.no_progress)
    # an infinite rate keeps the workload's lengths (a separate seeded stream) and zeroes the arrivals
    wl = workload_config(args, None if args.workload == "trace" and math.isinf(rate) else
                         (1.0 if math.isinf(rate) else rate))
    b = HttpBench(client, wl, rate, parse_percentile_metrics(args.percentile_metrics),
                  parse_percentiles(args.metric_percentiles), parse_goodput(args.goodput))
    try:
        result = bench_http(b)
    except ServerUnavailable as e:
        print(f"moeflow: error: {e}", file=sys.stderr)
        return 1
    paths = [args.json] if args.json else []
    if args.save_result:
        paths.append(os.path.join(args.result_dir, args.result_filename or _default_filename(args, rate)))
    for path in paths:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_json(path, result)
    return 0 if result["completed"] else 1


def _one_rate(text: str | None) -> float:
    """``--request-rate`` over HTTP: one rate per run, as vLLM (a number or inf; none given: inf)."""
    if text is None:
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--request-rate: over HTTP one rate per run (a number or inf), got {text!r}") from None


def result_json(b: HttpBench, m: dict, run: HttpRun) -> dict:
    """vLLM's saved-result layout: run settings, the metrics, then per-request samples."""
    ok = [o for o in run.outcomes if o.success]
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "moeflow", "base_url": b.client.base_url,
            "endpoint": b.client.endpoint, "model_id": b.client.model,
            "num_prompts": len(run.outcomes), "request_rate": b.rate if math.isfinite(b.rate) else "inf",
            "burstiness": b.workload.burstiness, "max_concurrency": b.client.max_concurrency,
            "goodput": b.goodput_ms or None,
            "workload": {k: v for k, v in b.workload.to_dict().items() if k != "rate_rps"},
            **m,
            "input_lens": [o.prompt_len for o in run.outcomes], "output_lens": [o.output_tokens for o in run.outcomes],
            "ttfts": [o.ttft_s for o in ok], "itls": [list(o.itl_s) for o in ok],
            "errors": [o.error for o in run.outcomes]}


def _default_filename(args: argparse.Namespace, rate: float) -> str:
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = os.path.basename((args.served_model_name or "server").rstrip("/"))
    return f"moeflow-{rate:g}qps{conc}-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
