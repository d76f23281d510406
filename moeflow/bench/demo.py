"""``moeflow demo`` (``make run``): the system the seeds describe against the aggregated baseline,
served over HTTP on ``tiny``.

For each system — prefill/decode disaggregation with an asap prefill instance (D=1 E=1) handing
each request's KV to an afd decode instance (M=1 N=1), then the synchronous baseline dep dp=4:
four worker processes each — it starts ``moeflow serve`` on a free port (``server_process.py``),
waits for /health, runs the benchmark of ``bench serve --base-url`` (``http_bench.bench_http``) at
each rate (the same seeded workload every time), and stops the server. Then it prints the result
tables side by side (TTFT, TPOT, TPS/user, output tokens/s per process), writes every run's JSON
and a TTFT-vs-rate plot to ``--out-dir``, and exits 0 only if every request of every run
completed. The servers' logs and each run's own table land in ``--out-dir``. It closes with what
``moeflow plan`` answers for the same question at the seeds' scale (DeepSeek-R1 on 8 GB200).
"""
from __future__ import annotations

import argparse
import os
import time

from moeflow.bench.http_metrics import parse_goodput, percentile_key
from moeflow.bench.server_process import ServeProcess
from moeflow.config import DTYPES
from moeflow.measure.rate_flag import add_request_rate
from moeflow.measure.workload import rates_of
from moeflow.plan.question import PlanQuestion

# (name, serve flags, config for measure.plot's label, worker processes)
SYSTEMS = (("pd", ["--mode", "pd", "--prefill", "mode=asap,attn_dp=1,moe_workers=1",
                   "--decode", "mode=afd,attn_workers=1,ffn_workers=1,micro_batches=2"],
            {"prefill": "asap D1E1", "decode": "afd M1N1"}, 4),
           ("dep", ["--mode", "dep", "--dp", "4"], {"dp": 4}, 4))
_ROWS = (("Successful requests", "completed", "d"), ("Benchmark duration (s)", "duration", ".2f"),
         ("Request throughput (req/s)", "request_throughput", ".2f"),
         ("Request goodput (req/s)", "request_goodput", ".2f"),
         ("Output token throughput (tok/s)", "output_throughput", ".2f"),
         ("Output tok/s per process", "output_throughput_per_process", ".2f"),
         ("Mean TPS/user (tok/s)", "mean_tps_user", ".2f"), ("P10 TPS/user (tok/s)", "p10_tps_user", ".2f"))


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="pd (asap prefill -> afd decode) vs dep over HTTP on the embedded model: "
                                    "tables side by side, a plot")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: what this machine computes natively")
    add_request_rate(p, "request rates (req/s), comma-separated", old="--rates", default="0.5,1,2")
    p.add_argument("--num-prompts", type=int, default=20, help="requests per rate")
    p.add_argument("--length-scale", type=float, default=0.03,
                   help="production workload scaled by this (0.03: mean ~150 prompt tokens)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (decode matters)")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], help="NAME:MS SLOs of request_goodput")
    p.add_argument("--out-dir", default="demo-out")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip the closing `moeflow plan` of DeepSeek-R1 on 8 GB200 (simulated, a few seconds)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeflow.measure.plot import plot_results

    rates = rates_of(args.request_rate)
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.monotonic()
    print(f"workload: production prompt lengths x {args.length_scale:g}, {args.num_prompts} requests per rate, "
          f"{args.max_tokens} output tokens, Poisson arrivals at {', '.join(f'{r:g}' for r in rates)} req/s; "
          f"model {args.model!r}", flush=True)
    results: dict[str, dict[float, dict]] = {}
    for name, flags, _, _ in SYSTEMS:
        results[name] = {}
        with ServeProcess(args.model, ["--dtype", args.dtype, *flags], os.path.join(args.out_dir, f"server-{name}.log")) as url:
            print(f"[{time.monotonic() - t0:3.0f} s] {name}: moeflow serve {' '.join(flags)} is up at {url} "
                  f"({_dtype_line(os.path.join(args.out_dir, f'server-{name}.log'))})", flush=True)
            for rate in rates:
                results[name][rate] = _bench(args, name, url, rate)
                m = results[name][rate]
                print(f"{name} @ {rate:g} req/s: {m['completed']}/{m['num_prompts']} completed, "
                      f"mean TTFT {m['mean_ttft_ms']:.0f} ms", flush=True)
    print()
    for n, _, _, procs in SYSTEMS:
        for m in results[n].values():
            m["output_throughput_per_process"] = m["output_throughput"] / procs
    print(side_by_side([(f"{n} @{r:g}", results[n][r]) for r in rates for n, _, _, _ in SYSTEMS]))
    slo = " and ".join(f"{k.upper()} <= {v:g} ms" for k, v in parse_goodput(args.goodput).items())
    print(f"(request goodput: completed requests per second with {slo}; --goodput)")
    plot = os.path.join(args.out_dir, "ttft_vs_rate.png")
    plot_results([{"mode": n, "config": cfg, "slo_ttft_s": None,
                   "points": [{"rps": r, "ttft_mean_s": results[n][r]["mean_ttft_ms"] / 1000} for r in rates]}
                  for n, _, cfg, _ in SYSTEMS], plot, title=f"{args.model}: mean TTFT vs request rate (HTTP)")
    print(f"\nwrote {plot} and the runs' JSON to {args.out_dir}/ in {time.monotonic() - t0:.0f} s")
    ok = all(m["completed"] == m["num_prompts"] for per in results.values() for m in per.values())
    if args.plan:
        _plan(args.out_dir)
    return 0 if ok else 1


# the same question at the seeds' scale: which prefill/decode split of 8 GB200 GPUs serves DeepSeek-R1
# (8K prompts, 1K outputs) best; estimates from each side simulated alone, a few seconds
PLAN = PlanQuestion(model="deepseek-r1", hardware="gb200", devices=8, isl=8192, isl_ratio=0.8, osl=1024, ttft_s=3,
                    tpot_ms=40, kinds=("pd",), confirm=0, top=0)


def _plan(out_dir: str) -> None:
    from moeflow.plan.cli import answer

    print()
    answer(PLAN, os.path.join(out_dir, "plan_deepseek_r1_gb200_8.json"))


def _dtype_line(log_path: str) -> str:
    """What the server logged about its dtype at start (the engine logs the choice and why)."""
    with open(log_path) as f:
        line = next((ln for ln in f if "moeflow.hardware" in ln), "")
    return line.split("moeflow.hardware: ", 1)[-1].strip() or "dtype not logged"


def _bench(args: argparse.Namespace, name: str, url: str, rate: float) -> dict:
    """One ``bench serve --base-url`` run (``bench_http``): its table goes to a file, its JSON too and
    is returned."""
    from moeflow.bench.http_bench import HttpBench, bench_http
    from moeflow.bench.http_client import HttpClientConfig
    from moeflow.measure.provenance import write_json
    from moeflow.measure.workload import WorkloadConfig

    stem = os.path.join(args.out_dir, f"{name}-{rate:g}rps")
    workload = WorkloadConfig(kind="production", rate_rps=rate, num_requests=args.num_prompts,
                              length_scale=args.length_scale, output_len=args.max_tokens)
    b = HttpBench(HttpClientConfig(url), workload, rate, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.0),
                  parse_goodput(args.goodput))
    with open(stem + ".txt", "w") as out:
        result = bench_http(b, out)
    if not result["completed"]:
        with open(stem + ".txt") as f:
            raise RuntimeError(f"bench serve against {name} at {rate:g} req/s completed no request:\n{f.read()}")
    write_json(stem + ".json", result)
    return result


def side_by_side(columns: list[tuple[str, dict]], percentiles: tuple[float, ...] = (50.0, 99.0)) -> str:
    """vLLM's result rows, one column per run."""
    width = max(11, *(len(c) + 1 for c, _ in columns))
    rows = [(label, key, fmt) for label, key, fmt in _ROWS]
    for metric, short in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows.append((f"Mean {short} (ms)", f"mean_{metric}_ms", ".1f"))
        rows += [(f"P{percentile_key(p)} {short} (ms)", f"p{percentile_key(p)}_{metric}_ms", ".1f")
                 for p in percentiles]
    lines = [f"{'':<32}" + "".join(f"{c:>{width}}" for c, _ in columns)]
    for label, key, fmt in rows:
        cells = [format(m[key], fmt) if m.get(key) is not None else "-" for _, m in columns]
        lines.append(f"{label:<32}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)
