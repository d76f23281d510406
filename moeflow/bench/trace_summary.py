"""``moeflow bench trace-summary``: where each worker's time went in a Chrome trace, per stage.

Reads what ``--trace`` wrote (engine or simulator) and prints, per process and thread, the seconds
and the share of the trace window spent in each span name (attention, experts, wait-dispatch, ...).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def add_parser(sub) -> None:
    p = sub.add_parser("trace-summary", help="time per worker and stage in a Chrome trace")
    p.add_argument("trace", metavar="TRACE.json")
    p.add_argument("--min-share", type=float, default=0.01, help="hide stages below this share of the window")
    p.set_defaults(func=run)


def summarize_trace(data: dict) -> tuple[float, dict[tuple[str, str, str], float]]:
    """-> (window seconds, {(process, thread, span name): seconds})."""
    events = data["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    if not spans:
        raise ValueError("the trace holds no spans")
    window_s = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6
    total: dict[tuple[str, str, str], float] = defaultdict(float)
    for e in spans:
        total[(procs[e["pid"]], threads[(e["pid"], e["tid"])], e["name"])] += e["dur"] / 1e6
    return window_s, dict(total)


def run(args: argparse.Namespace) -> int:
    with open(args.trace) as f:
        window_s, total = summarize_trace(json.load(f))
    print(f"trace window {window_s:.1f} s")
    print(f"{'process':>12} {'thread':>8} {'stage':>18} {'seconds':>8} {'share':>6}")
    for (proc, thread, name), s in sorted(total.items()):
        if s / window_s >= args.min_share:
            print(f"{proc:>12} {thread:>8} {name:>18} {s:>8.2f} {s / window_s:>6.1%}")
    return 0
