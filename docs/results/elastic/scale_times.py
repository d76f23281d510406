"""How long members take to join and leave while serving (docs/elastic.md).

    python docs/results/elastic/scale_times.py > docs/results/elastic/scale_times.txt

The embedded model (fp32), no load, six changes each way of each kind: afd's FFN daemons 2 <-> 3
(2 attention instances), asap's MoE workers 2 <-> 3 and asap's attention groups 1 <-> 2. Per change:
request -> the new membership serving (``switched``), -> the old member gone (``left``), the weights
moved and the slowest copy; then the same prompts' greedy output against before the changes.
"""
from __future__ import annotations

import statistics
import time

from moeflow import LLM, SamplingParams

DEPLOYMENTS = {
    "ffn": dict(mode="afd", attn_workers=2, ffn_workers=2, topology="all", max_ffn_workers=3, max_batch_tokens=64),
    "moe": dict(mode="asap", attn_dp=1, moe_workers=2, max_moe_workers=3),
    "attention": dict(mode="asap", attn_dp=1, max_attn_dp=2, moe_workers=2),
}
COUNTS = {"ffn": (3, 2), "moe": (3, 2), "attention": (2, 1)}


def measure(kind: str) -> None:
    with LLM("tiny", dtype="float32", **DEPLOYMENTS[kind]) as llm:
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        before = llm.generate([[1, 2, 3, 4]] * 4, sp)
        up, down = COUNTS[kind]
        times: dict[int, list[tuple[float, float]]] = {up: [], down: []}
        for n in (up, down) * 6:
            t0 = time.monotonic()
            e = llm.scale(**{kind: n})["events"][-1]
            times[n].append((e["seconds"], e["left_s"] - e["requested_s"]))
            print(f"{kind} -> {n}: {e['outcome']}, serving after {e['seconds']:.3f} s, old member gone after "
                  f"{e['left_s'] - e['requested_s']:.3f} s, moved {e['moved_bytes'] / 2**20:.1f} MiB in "
                  f"{e['move_s']:.3f} s (call {time.monotonic() - t0:.3f} s)")
        after = llm.generate([[1, 2, 3, 4]] * 4, sp)
        for n, name in ((up, f"up {down} -> {up}"), (down, f"down {up} -> {down}")):
            print(f"{kind} {name}: median serving after {statistics.median(s for s, _ in times[n]):.2f} s "
                  f"(min {min(s for s, _ in times[n]):.2f}, max {max(s for s, _ in times[n]):.2f}), old member gone "
                  f"after {statistics.median(x for _, x in times[n]):.2f} s ({len(times[n])} changes)")
        print(f"{kind}: greedy outputs after = before:", [o.outputs[0].token_ids for o in after] ==
              [o.outputs[0].token_ids for o in before])


def main() -> None:
    for kind in DEPLOYMENTS:
        measure(kind)


if __name__ == "__main__":
    main()
