"""Chrome/Perfetto trace of a deployment's spans, and per-track busy fractions."""
from __future__ import annotations

import json
from collections import defaultdict

from moeflow.messages import Span

# spans that are not work: waiting on another stage, or idle
NOT_BUSY = {"wait-combine", "wait-dispatch", "idle"}


def write_chrome_trace(spans: list[Span], path: str, meta: dict | None = None) -> None:
    """One process track per worker, one thread track per worker thread; times in microseconds.
    ``meta``: extra top-level keys (a result file's provenance; trace viewers ignore them)."""
    if not spans:
        raise ValueError("no spans to write: was the deployment started with trace=True?")
    t0 = min(s.start_s for s in spans)
    pids: dict[str, int] = {}
    tids: dict[str, int] = {}
    events = []
    for s in spans:
        proc, _, thread = s.track.partition("/")
        pid = pids.setdefault(proc, len(pids) + 1)
        tid = tids.setdefault(s.track, len(tids) + 1)
        events.append({"name": s.name, "ph": "X", "ts": (s.start_s - t0) * 1e6, "dur": (s.end_s - s.start_s) * 1e6,
                       "pid": pid, "tid": tid, "args": s.args})
    for proc, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": proc}})
    for track, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pids[track.partition("/")[0]], "tid": tid,
                       "args": {"name": track.partition("/")[2]}})
    with open(path, "w") as f:
        json.dump({**(meta or {}), "traceEvents": events, "displayTimeUnit": "ms"}, f)


def busy_fractions(spans: list[Span], start_s: float | None = None, end_s: float | None = None) -> dict[str, float]:
    """Per process: the fraction of [start_s, end_s] covered by work spans of its compute thread
    ("main"); communication threads overlap compute and are not counted again."""
    work = [s for s in spans if s.name not in NOT_BUSY and s.track.endswith("/main")]
    if not work:
        return {}
    lo = min(s.start_s for s in work) if start_s is None else start_s
    hi = max(s.end_s for s in work) if end_s is None else end_s
    by_proc: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in work:
        a, b = max(s.start_s, lo), min(s.end_s, hi)
        if b > a:
            by_proc[s.track.partition("/")[0]].append((a, b))
    out = {}
    for proc, iv in by_proc.items():
        iv.sort()
        covered, cur_a, cur_b = 0.0, None, None
        for a, b in iv:  # union of intervals
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    covered += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        covered += cur_b - cur_a
        out[proc] = covered / (hi - lo) if hi > lo else 0.0
    return out
