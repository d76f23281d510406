"""How long afd's FFN daemons take to join and leave while serving (docs/elastic.md).

    python docs/results/elastic/scale_times.py > docs/results/elastic/scale_times.txt

The embedded model (fp32), 2 attention instances, FFN daemons 2 -> 3 -> 2 six times, no load: per
change, the request -> the new membership serving (``switched``), -> the old member gone (``left``),
the weights moved, and the daemons after; then the same prompts' greedy output against before.
"""
from __future__ import annotations

import statistics
import time

from moeflow import LLM, SamplingParams


def main() -> None:
    with LLM("tiny", dtype="float32", mode="afd", attn_workers=2, ffn_workers=2, topology="all", max_ffn_workers=3,
             max_batch_tokens=64) as llm:
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        before = llm.generate([[1, 2, 3, 4]] * 4, sp)
        times: dict[int, list[tuple[float, float]]] = {3: [], 2: []}
        for n in (3, 2) * 6:
            t0 = time.monotonic()
            e = llm.scale(ffn=n)["events"][-1]
            times[n].append((e["seconds"], e["left_s"] - e["requested_s"]))
            print(f"ffn -> {n}: {e['outcome']}, serving after {e['seconds']:.3f} s, old member gone after "
                  f"{e['left_s'] - e['requested_s']:.3f} s, moved {e['moved_bytes'] / 2**20:.1f} MiB "
                  f"(call {time.monotonic() - t0:.3f} s); daemons "
                  f"{sorted(w.index for w in llm.engine.deployment.workers if w.role == 'ffn')}")
        after = llm.generate([[1, 2, 3, 4]] * 4, sp)
        for n, name in ((3, "up 2 -> 3"), (2, "down 3 -> 2")):
            print(f"{name}: median serving after {statistics.median(s for s, _ in times[n]):.2f} s, old member gone "
                  f"after {statistics.median(x for _, x in times[n]):.2f} s ({len(times[n])} changes)")
        print("greedy outputs after = before:", [o.outputs[0].token_ids for o in after] ==
              [o.outputs[0].token_ids for o in before])


if __name__ == "__main__":
    main()
