"""Writes docs/results/multihost.md from run.sh's JSON files (one host vs two hosts, and the link)."""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
        ("request_throughput", "requests/s", "{:.2f}"), ("output_throughput", "output tok/s", "{:.1f}"),
        ("mean_ttft_ms", "mean TTFT ms", "{:.1f}"), ("median_ttft_ms", "median TTFT ms", "{:.1f}"),
        ("p99_ttft_ms", "p99 TTFT ms", "{:.1f}"), ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
        ("mean_itl_ms", "mean ITL ms", "{:.1f}")]


def main() -> None:
    runs = {name: json.load(open(os.path.join(HERE, f"{name}.json"))) for name in ("one_host", "two_hosts")}
    link = json.load(open(os.path.join(HERE, "link.json")))
    commit = open(os.path.join(HERE, "commit.txt")).read().strip()
    lines = ["# Several hosts: asap D1 E2 on one host and across two (network namespaces)", "",
             f"Commit `{commit[:12]}`; command: `docs/results/multihost/run.sh` (root), then "
             f"`python docs/results/multihost/report.py`. Model `tiny`, `moeflow serve --mode asap --moe-workers 2`; "
             f"two hosts = node 0 (server, engine, attention worker) in this namespace and the two MoE workers "
             f"behind `moeflow worker-node` in a network namespace joined by a veth pair (gloo on the veth); the "
             f"same 2-core machine runs both, so this shows the cost of the links, not of more hardware.", "",
             "`moeflow bench serve --base-url ... --workload fixed --fixed-len 64 --max-tokens 16 --request-rate 4 "
             "--num-prompts 24`:", "", "| metric | one host (shm) | two hosts (gloo) |", "|---|---|---|"]
    for key, label, fmt in KEYS:
        if all(key in r for r in runs.values()):
            lines.append(f"| {label} | " + " | ".join(fmt.format(runs[n][key]) for n in ("one_host", "two_hosts")) + " |")
    lines += ["", f"The link itself (`link.py`): one dispatch -> combine round trip over the `dist` transport (gloo), "
              f"H = {link['hidden']} {link['dtype']}, median of 30:", "",
              "| rows | MiB each way | round trip µs | GB/s (both ways) |", "|---|---|---|---|"]
    for r in link["rows"]:
        lines.append(f"| {r['rows']} | {r['bytes'] / 2**20:.3f} | {r['rtt_us']:.0f} | {r['gbps']:.2f} |")
    with open(os.path.join(HERE, "..", "multihost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
