"""An elastic deployment against fixed ones, measured on this machine (docs/results/elastic.md, "Measured
here"), and set beside the simulator's run of the same experiment file: afd's A:F, pd's xPyD, or dep's
ranks.

    python docs/results/elastic/measured.py configs/elastic-afd-here.yaml docs/results/elastic/measured_here.json \
        > docs/results/elastic/measured_here.txt
    python docs/results/elastic/measured.py --table docs/results/elastic/measured_here.json \
        docs/results/elastic/sim_here.json
    (pd: configs/elastic-pd-here.yaml, measured_pd_here.json, sim_pd_here.json; dep: configs/elastic-dep-here.yaml,
    measured_dep_here.json, sim_dep_here.json; a third argument: fewer seeds)

For each repeat r (the workload's seed + r, as ``moeflow simulate --repeats`` draws them, so both see
the same arrivals and lengths) and each system in turn (interleaved, so drift in the machine's speed
falls on every system alike): a real ``moeflow serve`` with the system's layout (``--autoscale`` with
its policy for the elastic one), one short request to pay the one-time costs, then the workload over
HTTP (bench serve's client: streamed completions, ignore_eos). A member costs from its start to its
exit (``measure/membership_cost.py``, from GET /scale's events on the server's monotonic clock, which
is this process's), from the workload's start to the last answer. Goodput: requests within both SLOs (TTFT, and TPOT as
bench serve computes it) per process-second. The decisions' reasons come from the server's log.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time

import httpx
import yaml

from moeflow.bench.http_client import HttpClientConfig, run_requests, token_prompts
from moeflow.bench.server_process import ServeProcess
from moeflow.engine.args import layout_flags
from moeflow.experiment.serve import load_experiment
from moeflow.experiment.system import autoscale_policy
from moeflow.measure.membership_cost import process_seconds
from moeflow.measure.provenance import provenance
from moeflow.measure.workload import WorkloadRequest, generate_requests

ENGINE_FLAGS = ("num_kv_blocks", "max_num_seqs", "memory_budget_gib", "max_model_len")
# afd: attention, ffn; pd: prefill, decode; dep and dwdp: ranks alone
DECISION = re.compile(r"autoscale: ([\w+]+) -> (\w+) (\d+)(?:, (\w+) (\d+))?")


def serve_flags(spec, dtype: str, policy_path: str | None) -> list[str]:
    """``moeflow serve``'s flags for one system of the file (its layout, the engine keys it sets)."""
    flags = layout_flags(spec.layout) + ["--dtype", dtype, "--served-model-name", "m"]
    default = type(spec.engine)()
    for f in dataclasses.fields(spec.engine):
        value = getattr(spec.engine, f.name)
        if value == getattr(default, f.name) or f.name in ("model", "dtype", "mode"):
            continue
        if f.name not in ENGINE_FLAGS:
            raise SystemExit(f"systems.{spec.name}.engine.{f.name}: not passed to moeflow serve by this script")
        flags += [f"--{f.name.replace('_', '-')}", str(value)]
    if spec.autoscale:
        policy = dict(spec.autoscale)
        most = {"pd": {"--max-prefill-instances": "max_prefill", "--max-decode-instances": "max_decode"},
                "dep": {}}.get(spec.layout.mode, {"--max-attn-workers": "max_attention", "--max-ffn-workers": "max_ffn"})
        flags += ["--autoscale", policy_path] + [x for flag, key in most.items() for x in (flag, str(policy[key]))]
    return flags


def members(spec, status: dict) -> dict[str, int]:
    """The deployment's members by kind, from GET /scale (a fixed afd's lists no attention)."""
    lay = spec.layout
    if lay.mode == "pd":
        return {"prefill": status["prefill"], "decode": status["decode"]}
    if lay.mode == "dep":  # a rank: GET /scale's "dep" (its max_dp is the layout's, in its flags)
        return {"dep": status["dep"]}
    return {"attention": status.get("attention", lay.attn_workers), "ffn": status["ffn"]}


def processes_per_member(spec) -> dict[str, int]:
    lay = spec.layout
    return {"prefill": lay.prefill.num_processes, "decode": lay.decode.num_processes} if lay.mode == "pd" else {}


def one_run(exp, name: str, seed: int, log_path: str) -> dict:
    spec = exp.systems[name]
    reqs = generate_requests(exp.point_workload(exp.rps[0], seed))  # the simulator's very requests
    with tempfile.TemporaryDirectory() as tmp:
        policy_path = os.path.join(tmp, "policy.yaml")
        if spec.autoscale:
            with open(policy_path, "w") as f:
                yaml.safe_dump(dict(spec.autoscale), f)
        # the controller's windows in the log (windows.py reads them), for the elastic system
        os.environ["MOEFLOW_LOGGING_LEVEL"] = "DEBUG" if spec.autoscale else "INFO"
        run, start, status, t0, t1 = _serve(exp, spec, serve_flags(spec, exp.dtype, policy_path), reqs, seed, log_path)
    with open(log_path) as f:
        decisions = [m.groups() for m in DECISION.finditer(f.read())]
    ok = [o for o in run.outcomes if o.success]
    good = [o for o in ok if o.ttft_s <= exp.slo_ttft_s and (o.tpot_s or 0.0) <= exp.slo_tpot_s]
    per = processes_per_member(spec)
    proc_s = process_seconds(sum(n * per.get(k, 1) for k, n in start.items()), status["events"], t0, t1, per)
    tpots = [o.tpot_s for o in ok if o.tpot_s is not None]
    return {"system": name, "seed": seed, "log": log_path, "t0_s": t0, "requests": len(reqs), "answered": len(ok),
            "good": len(good),
            "duration_s": t1 - t0, "process_s": proc_s, "goodput_per_process_s": len(good) / proc_s,
            "ttft_p90_s": _p90([o.ttft_s for o in ok]), "tpot_p90_s": _p90(tpots),
            "members_at_end": members(spec, status),
            "decisions": [{"reason": d[0]} | {k: int(v) for k, v in zip(d[1::2], d[2::2]) if k is not None}
                          for d in decisions],
            "events": [{"kind": e["kind"], "before": e["before"], "after": e["after"], "outcome": e["outcome"],
                        "asked_s": e["requested_s"] - t0,
                        "serving_s": None if e["switched_s"] is None else e["switched_s"] - t0}
                       for e in status["events"] if e["requested_s"] >= t0]}


def _serve(exp, spec, flags: list[str], reqs, seed: int, log_path: str):
    """One server's run: the probe request, then the workload; its members before and its events after."""
    with ServeProcess(exp.model, flags, log_path) as url:
        client = HttpClientConfig(url, model="m", progress=False)
        probe = [WorkloadRequest(0.0, 16, 2)]
        assert run_requests(client, probe, token_prompts(probe, seed + 1)).outcomes[0].success
        start = members(spec, httpx.get(url + "/scale", timeout=30).json())
        t0 = time.monotonic()
        run = run_requests(client, reqs, token_prompts(reqs, seed))
        t1 = time.monotonic()
        status = httpx.get(url + "/scale", timeout=30).json()
    return run, start, status, t0, t1


def _p90(xs: list[float]) -> float | None:
    # NOTE: statistics' exclusive quantile, where the simulator's summary takes numpy's interpolated one
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else (xs[0] if xs else None)


def main(config: str, out: str, repeats: str | None = None) -> None:
    """``repeats``: fewer seeds than the file's (a check rather than a comparison)."""
    exp = load_experiment(config)
    runs = []
    for r in range(exp.repeats if repeats is None else int(repeats)):
        for name in exp.systems:
            res = one_run(exp, name, exp.workload.seed + r, f"/tmp/moeflow-elastic-{name}-{r}.log")
            runs.append(res)
            print(f"[seed {res['seed']}] {name}: {res['answered']}/{res['requests']} answered, {res['good']} within "
                  f"both SLOs, {res['process_s']:.1f} process-s over {res['duration_s']:.1f} s: "
                  f"{res['goodput_per_process_s']:.4f} good requests per process-second; TTFT p90 "
                  f"{res['ttft_p90_s']:.2f} s, TPOT p90 {1e3 * res['tpot_p90_s']:.0f} ms", flush=True)
            for e in res["events"]:
                print(f"    {e['kind']} {e['before']} -> {e['after']} asked at {e['asked_s']:.1f} s, serving at "
                      f"{'-' if e['serving_s'] is None else format(e['serving_s'], '.1f')} s ({e['outcome']})")
            if res["decisions"]:
                print("    reasons: " + ", ".join(d["reason"] for d in res["decisions"]))
    with open(out, "w") as f:
        json.dump({"provenance": provenance(sys.argv), "config": config, "runs": runs}, f, indent=1)
    table(out)


def table(measured: str, simulated: str | None = None) -> None:
    """Per system: the median over the seeds (min-max), measured and, given, simulated."""
    with open(measured) as f:
        result = json.load(f)
    runs, exp = result["runs"], load_experiment(result["config"])
    holds = {n: autoscale_policy(x)[0].hold_s for n, x in exp.systems.items() if x.autoscale}
    sim = {}
    if simulated:
        with open(simulated) as f:
            for name, s in json.load(f)["systems"].items():
                sim[name] = [rep["sweep"][0] for rep in s.get("repeats") or [{"sweep": s["points"]}]]
    print("| system | where | processes, mean | goodput per process-second | within both SLOs | TTFT p90 s | "
          "TPOT p90 ms | changes |")
    print("|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == name]
        print(f"| {name} | measured | {_cell([r['process_s'] / r['duration_s'] for r in mine], '.2f')} | "
              f"{_cell([r['goodput_per_process_s'] for r in mine], '.4f')} | "
              f"{_cell([100 * r['good'] / r['requests'] for r in mine], '.0f')}% | "
              f"{_cell([r['ttft_p90_s'] for r in mine], '.2f')} | {_cell([1e3 * r['tpot_p90_s'] for r in mine], '.0f')} | "
              f"{_cell([len(r['events']) for r in mine], 'd')} |")
        if name in sim:
            pts = sim[name]
            print(f"| {name} | simulated | {_cell([p['process_s'] / p['duration_s'] for p in pts], '.2f')} | "
                  f"{_cell([p['goodput_per_process_s'] for p in pts], '.4f')} | "
                  f"{_cell([100 * p['slo_attainment'] for p in pts], '.0f')}% | "
                  f"{_cell([p['ttft_p90_s'] for p in pts], '.2f')} | {_cell([1e3 * p['tpot_p90_s'] for p in pts], '.0f')} | "
                  f"{_cell([len(p.get('membership_changes') or []) for p in pts], 'd')} |")


    for name in holds:
        for r in (r for r in runs if r["system"] == name):
            print(f"\n{name}, seed {r['seed']}, measured: {r['answered']} of {r['requests']} answered; "
                  f"{reversals(r['events'], holds[name])} changes undone within hold_s ({holds[name]:g} s); "
                  + "; ".join(f"{e['kind']} {e['before']} -> {e['after']} asked at {e['asked_s']:.1f} s, serving "
                              f"{'-' if e['serving_s'] is None else format(e['serving_s'] - e['asked_s'], '.1f')} s later"
                              for e in r["events"]) + " (reasons: " + ", ".join(d["reason"] for d in r["decisions"]) + ")")
        for k, p in enumerate(sim.get(name, [])):
            print(f"{name}, seed {k}, simulated: " + "; ".join(
                f"{c['side']} {c['before']} -> {c['after']} asked at {c['asked_s']:.1f} s, serving "
                f"{c['done_s'] - c['asked_s']:.1f} s later ({c['reason']})" for c in p.get("membership_changes") or []))


def reversals(events: list[dict], hold: float) -> int:
    """Changes that undo the one before on the same side within ``hold`` seconds (flapping)."""
    n, last = 0, {}
    for e in events:
        prev = last.get(e["kind"])
        if prev is not None and (prev["after"] - prev["before"]) * (e["after"] - e["before"]) < 0 \
                and e["asked_s"] - prev["asked_s"] < hold:
            n += 1
        last[e["kind"]] = e
    return n


def _cell(values: list, fmt: str) -> str:
    med = statistics.median(values)
    med = int(med) if fmt == "d" else med
    return format(med, fmt) if len(values) == 1 or min(values) == max(values) else \
        f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(*sys.argv[2:4])
    else:
        main(*sys.argv[1:4])
