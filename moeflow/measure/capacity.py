"""The machine's limit, the anchor of every speed-up claim: prompt tokens/s the cores would sustain
if each did only the colocated model's work, with no waiting, no transport and no imbalance.

From a one-process ``moeflow profile`` (the colocated stage costs measured here), a request of n
prompt tokens costs: its attention over its own causal pairs (the profile's fit), the LM head,
and its routed experts at the best per-pair rate the profile measured (large batches, all experts
local): a bound no real deployment beats, since batching can only approach that rate. Then

    capacity = cores x sum(prompt tokens) / sum(per-request compute seconds)

over the experiment's workload. Each system's saturation throughput is reported as a fraction of
it, with the time split (from worker traces) that explains the rest. Pure Python.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

from moeflow.measure.workload import WorkloadConfig, generate_requests

# trace span names by what the time was spent on (workers/stages.py, schedule.py, experts.py, moe.py)
COMPUTE = {"attention", "router", "combine", "experts", "sample", "dense"}
TRANSPORT = {"dispatch", "combine-send"}  # copying rows out; an inline MoE worker's "recv" is mostly waiting
WAIT = {"wait-combine", "wait-dispatch", "wait-pull"}  # a barrier (dep), another stage's work (asap), a late pull (dwdp)


def request_compute_s(profile: dict, prompt_len: int) -> float:
    """Colocated compute of one lone request, experts at the profile's best per-pair rate."""
    a, h = profile["attention"]["fit"], profile["head"]["fit"]
    n = prompt_len
    pairs = n * (n + 1) // 2
    attn = a["c0"] + a["per_token"] * n + a["per_pair"] * pairs + a["per_seq"]
    table = profile["experts"][str(profile["num_experts"])]  # all experts local, as colocated holds them
    best_s_per_pair = min(s / r for r, s in table if r > 0)
    experts = n * profile["top_k"] * best_s_per_pair
    head = h["c0"] + h["per_token"] * n + h["per_sampled"]
    return profile["num_layers"] * (attn + experts) + head


def capacity_tok_s(profile: dict, workload: WorkloadConfig, cores: int, num_samples: int = 4000) -> dict:
    """The machine's capacity for ``workload``'s prompt lengths (``num_samples`` of them, drawn
    with its seed; the rate does not matter)."""
    reqs = generate_requests(dataclasses.replace(workload, rate_rps=1.0, duration_s=None, num_requests=num_samples))
    if not reqs:
        raise ValueError("capacity: the workload has no requests")
    tokens = sum(r.prompt_len for r in reqs)
    compute = sum(request_compute_s(profile, r.prompt_len) for r in reqs)
    return {"tok_s": cores * tokens / compute, "cores": cores, "mean_prompt_tokens": tokens / len(reqs),
            "mean_request_compute_s": compute / len(reqs), "profile_dtype": profile.get("dtype")}


def load_profile(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


KINDS = {"compute": COMPUTE, "transport": TRANSPORT, "wait": WAIT}


def steady_window(spans: list, run_start_s: float, run_end_s: float) -> tuple[float, float] | None:
    """The middle 80% of the span-covered part of one run [run_start_s, run_end_s].

    Spans recorded outside the run do not stretch it: a thread that works past the engine's last
    result (dwdp's copy thread pulls the next batch's first layers) hands its spans in with the
    *next* collection, minutes later when other systems ran in between."""
    inside = [s for s in spans if s.end_s > run_start_s and s.start_s < run_end_s]
    if not inside:
        return None
    lo = max(run_start_s, min(s.start_s for s in inside))
    hi = min(run_end_s, max(s.end_s for s in inside))
    return lo + 0.1 * (hi - lo), hi - 0.1 * (hi - lo)


def time_split(spans: list, start_s: float, end_s: float, kinds: dict[str, set[str]] = KINDS,
               rest: str = "idle") -> dict[str, dict[str, float]]:
    """Per process: the fraction of [start_s, end_s] its main thread spent on each kind of span
    (default: computed, transported, waited on other stages — a barrier or a pipeline bubble), and
    ``rest``: the time no span covers (no work item at all, or the gaps between stages)."""
    window = end_s - start_s
    kind_of = {name: kind for kind, names in kinds.items() for name in names}
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(kinds, 0.0))
    for s in spans:
        proc, _, thread = s.track.partition("/")
        if thread != "main":
            continue
        a, b = max(s.start_s, start_s), min(s.end_s, end_s)
        kind = kind_of.get(s.name)
        if b > a and kind is not None:
            out[proc][kind] += (b - a) / window
    for split in out.values():
        split[rest] = max(0.0, 1.0 - sum(split[k] for k in kinds))
    return dict(out)


def thread_busy(spans: list, start_s: float, end_s: float, thread: str) -> dict[str, float]:
    """Per process: the fraction of [start_s, end_s] its ``thread`` spent in spans (dwdp's copy
    thread pulling experts: the copies' share of the rank's time, on a core the rank shares)."""
    out: dict[str, float] = defaultdict(float)
    for s in spans:
        proc, _, th = s.track.partition("/")
        a, b = max(s.start_s, start_s), min(s.end_s, end_s)
        if th == thread and b > a:
            out[proc] += (b - a) / (end_s - start_s)
    return dict(out)
