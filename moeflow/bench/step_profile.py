"""One profiled step in numbers: operations issued, the device's busy share, the costliest operations.

CUDA: the kernels the step launched (memcpy and memset counted apart), busy = the union of every
device activity's interval, top = kernels by total device time. CPU, where ops run on the calling
thread: the top-level ops (what Python called; their children run inside them), busy = the union of
their intervals, top = ops by self time. The span is the profiled step's, first event to last; the
profiler's own bookkeeping lengthens a CPU step, so its busy share is a lower bound there.
"""
from __future__ import annotations

from collections import defaultdict

_NAME_CHARS = 120  # CUDA kernel names are whole template instantiations


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length (s) covered by intervals given in microseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def _kind(e) -> str | None:
    return getattr(e, "activity_type", None)


def summarize(events, device_type: str, top: int = 10) -> dict:
    cpu_ops = [e for e in events if e.device_type.name == "CPU" and (_kind(e) in (None, "cpu_op"))
               and "::" in e.name]
    device = [e for e in events if e.device_type.name != "CPU" and _kind(e) != "gpu_user_annotation"]
    spans = [(e.time_range.start, e.time_range.end) for e in cpu_ops + device]
    wall_s = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e6 if spans else 0.0
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    if device_type == "cuda":
        kernels = [e for e in device if _kind(e) not in ("gpu_memcpy", "gpu_memset")
                   and not e.name.startswith(("Memcpy", "Memset"))]
        busy_s = _union_s([(e.time_range.start, e.time_range.end) for e in device])
        for e in kernels:
            times[e.name[:_NAME_CHARS]] += (e.time_range.end - e.time_range.start) / 1e6
            counts[e.name[:_NAME_CHARS]] += 1
        out = {"ops_what": "CUDA kernels launched", "ops": len(kernels), "copies": len(device) - len(kernels)}
    else:
        top_level = [e for e in cpu_ops if e.cpu_parent is None]
        busy_s = _union_s([(e.time_range.start, e.time_range.end) for e in top_level])
        for e in cpu_ops:
            times[e.name] += e.self_cpu_time_total / 1e6
            counts[e.name] += 1
        out = {"ops_what": "top-level CPU ops", "ops": len(top_level), "copies": None}
    ranked = sorted(times, key=times.get, reverse=True)[:top]
    return {**out, "span_s": wall_s, "busy_s": busy_s, "busy_share": busy_s / wall_s if wall_s else None,
            "top": [{"name": n, "count": counts[n], "seconds": times[n],
                     "share_of_span": times[n] / wall_s if wall_s else None} for n in ranked]}
