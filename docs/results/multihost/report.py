"""``python docs/results/multihost/report.py [OUT.md]`` writes docs/results/multihost.md (or OUT.md)
from run.sh's JSON files: one host vs two hosts over the interleaved repeats (mean ± 95%
t-interval, paired ratio, verdict), and the link."""
from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
from moeflow.measure.stats import mean_ci, paired_ratio_ci, verdict  # noqa: E402

NAMES = ("one_host", "two_hosts")
KEYS = [("completed", "completed"), ("failed", "failed"),
        ("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
        ("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"),
        ("p99_ttft_ms", "p99 TTFT ms"), ("mean_tpot_ms", "mean TPOT ms"),
        ("mean_itl_ms", "mean ITL ms")]


def runs(name: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(HERE, f"{name}_r*.json")), key=lambda f: int(f.rsplit("_r", 1)[1][:-5]))
    return [json.load(open(f)) for f in files]


def main(out: str = os.path.join(HERE, "..", "multihost.md")) -> None:
    data = {n: runs(n) for n in NAMES}
    k = min(len(v) for v in data.values())
    link = json.load(open(os.path.join(HERE, "link.json")))
    commit = open(os.path.join(HERE, "commit.txt")).read().split()
    # the HTTP client records no ISA (it imports no torch); link.py's process on the same machine does
    prov = link["provenance"]
    cpu = f"{prov['cpu_model']} ({prov.get('isa', '?')}), dtype auto = {prov.get('auto_dtype', '?')}"
    lines = ["# Several hosts: asap D1 E2 on one host and across two (network namespaces)", "",
             f"Commit `{commit[0][:12]}`{' (dirty)' if 'dirty' in commit else ''}, {cpu}, 2 cores; command: "
             f"`sudo docs/results/multihost/run.sh`, then `python docs/results/multihost/report.py`. Model `tiny`, "
             f"`moeflow serve --mode asap --moe-workers 2`; two hosts = node 0 (server, engine, attention worker) in "
             f"this namespace and the two MoE workers behind `moeflow worker-node` in a network namespace joined by a "
             f"veth pair (gloo on the veth). The same 2-core machine runs both, so this shows the cost of the links, "
             f"not of more hardware. Both deployments stay up together; the {k} bench runs of each alternate "
             f"(order flipped every repeat, seeds 0..{k - 1} shared).", "",
             "`moeflow bench serve --base-url ... --workload fixed --fixed-len 64 --max-tokens 16 --request-rate 4 "
             "--num-prompts 24`; mean ± 95% t-interval over repeats, ratio = two hosts / one host paired by seed:", "",
             "| metric | one host (shm) | two hosts (gloo) | ratio | verdict |", "|---|---|---|---|---|"]
    for key, label in KEYS:
        vals = {n: [r.get(key) for r in data[n][:k]] for n in NAMES}
        if any(v is None for vs in vals.values() for v in vs):
            continue
        a, b = mean_ci(vals["one_host"]), mean_ci(vals["two_hosts"])
        ratio = paired_ratio_ci(vals["two_hosts"], vals["one_host"])
        lines.append(f"| {label} | {a.fmt()} | {b.fmt()} | {ratio.fmt() if ratio else '-'} | "
                     f"{verdict(a, b, ratio) if key not in ('completed', 'failed') else ''} |")
    lines += ["", f"The link itself (`link.py`): one dispatch -> combine round trip over the `dist` transport (gloo) "
              f"between the namespaces, H = {link['hidden']} {link['dtype']}, median of 30:", "",
              "| rows | MiB each way | round trip µs | GB/s (both ways) |", "|---|---|---|---|"]
    for r in link["rows"]:
        lines.append(f"| {r['rows']} | {r['bytes'] / 2**20:.3f} | {r['rtt_us']:.0f} | {r['gbps']:.2f} |")
    lines += ["", "On one host the same dispatch/combine goes through shared memory: `docs/results/comm.md` "
              "(`moeflow bench comm`) has its latencies."]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:2])
