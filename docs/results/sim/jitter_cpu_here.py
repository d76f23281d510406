"""The dep ranks' barrier wait at equal work, on this machine's engine: the calibration of the
simulator's compute jitter for profiled (cpu-here) costs (moeflow/sim/jitter.py).

``python docs/results/sim/jitter_cpu_here.py OUT.json [PROMPT_TOKENS ...]``: dep with 2 ranks, a stream of prompts of
one length, one prompt per rank per step (max_batch_tokens = the prompt), so every rank does the
same work at every layer; the ranks' main-thread spans split into compute / transport / wait over
the steady middle of each repeat. The wait is what a barrier costs when the work is equal.
"""
from __future__ import annotations

import statistics
import sys
import time

from moeflow import LLM, SamplingParams
from moeflow.measure.capacity import steady_window, time_split
from moeflow.measure.provenance import write_json
from moeflow.sim.jitter import Jitter

TOKENS_PER_RUN, REPEATS = 24 * 1024, 3


def measure(prompt: int) -> dict:
    stream = max(6, TOKENS_PER_RUN // prompt) // 2 * 2  # even: each rank the same number of steps
    prompts = [[(7 * i + j) % 250 + 3 for j in range(prompt)] for i in range(stream)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny", mode="dep", dp=2, max_batch_tokens=prompt, num_threads=1, trace=True)
    try:
        llm.generate(prompts[:2], params)
        llm.engine.collect_spans()
        repeats = []
        for _ in range(REPEATS):
            t0 = time.monotonic()
            llm.generate(prompts, params)
            t1 = time.monotonic()
            spans = llm.engine.collect_spans()
            lo, hi = steady_window(spans, t0, t1)
            split = time_split(spans, lo, hi)
            repeats.append({"window_s": hi - lo, "split": split})
            print({p: {k: round(v, 3) for k, v in s.items()} for p, s in split.items()}, flush=True)
    finally:
        llm.shutdown()
    ranks = [s for r in repeats for p, s in r["split"].items() if p.startswith("dep")]
    # the two ranks' compute + wait per layer phase is max(f1, f2) times the mean: wait / compute = E[max] - 1
    excess = statistics.median(s["wait"] / s["compute"] for s in ranks)
    cv = cv_for_excess(excess)
    print(f"{prompt}-token prompts: rank wait {min(s['wait'] for s in ranks):.3f}-{max(s['wait'] for s in ranks):.3f}"
          f" of the window, wait/compute {excess:.3f} -> compute_jitter_cv {cv:.3f}")
    return {"prompt_tokens": prompt, "stream": stream, "repeats": repeats, "wait_over_compute": excess,
            "compute_jitter_cv": cv}


def cv_for_excess(excess: float, n: int = 2) -> float:
    """The jitter CV whose E[max of n factors] - 1 is ``excess`` (bisection)."""
    lo, hi = 0.0, 0.99
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Jitter(mid, 0).expected_max(n) - 1 < excess else (lo, mid)
    return (lo + hi) / 2


if __name__ == "__main__":
    rows = [measure(int(p)) for p in (sys.argv[2:] or ["1024"])]
    write_json(sys.argv[1], {"model": "tiny", "mode": "dep", "dp": 2, "points": rows}, sys.argv)
