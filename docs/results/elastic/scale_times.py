"""How long members take to join and leave while serving (docs/elastic.md).

    python docs/results/elastic/scale_times.py > docs/results/elastic/scale_times.txt
    python docs/results/elastic/scale_times.py "dep ranks" > docs/results/elastic/scale_times_dep.txt
    python docs/results/elastic/scale_times.py "dwdp ranks" > docs/results/elastic/scale_times_dwdp.txt
    python docs/results/elastic/scale_times.py "pd prefill" "pd decode" > docs/results/elastic/scale_times_pd.txt

The embedded model (fp32), no load, six changes each way of each kind: afd's FFN daemons 2 <-> 3
(2 attention instances), asap's MoE workers 2 <-> 3, asap's attention groups 1 <-> 2, afd's
attention instances 1 <-> 2, dep's ranks 2 <-> 3, dwdp's ranks 2 <-> 3, and a pd deployment's (one-rank dep
instances) prefill and decode instances 1 <-> 2. Per change:
request -> the new membership serving (``switched``), -> the old member gone (``left``), the weights
moved and the slowest copy; then the same prompts' greedy output against before the changes.
"""
from __future__ import annotations

import statistics
import sys
import time

from moeflow import LLM, SamplingParams

KINDS = [  # (label, the scale argument, the deployment, (up, down))
    ("afd ffn", "ffn", dict(mode="afd", attn_workers=2, ffn_workers=2, topology="all", max_ffn_workers=3,
                            max_batch_tokens=64), (3, 2)),
    ("asap moe", "moe", dict(mode="asap", attn_dp=1, moe_workers=2, max_moe_workers=3), (3, 2)),
    ("asap attention", "attention", dict(mode="asap", attn_dp=1, max_attn_dp=2, moe_workers=2), (2, 1)),
    ("afd attention", "attention", dict(mode="afd", attn_workers=1, ffn_workers=2, topology="all",
                                        max_attn_workers=2, max_batch_tokens=64), (2, 1)),
    ("dep ranks", "ep_size", dict(mode="dep", dp=2, max_dp=3), (3, 2)),
    ("dwdp ranks", "ep_size", dict(mode="dwdp", dp=2, max_dp=3), (3, 2)),
    ("pd prefill", "prefill", dict(mode="pd", prefill={"mode": "dep"}, decode={"mode": "dep"},
                                   max_prefill_instances=2), (2, 1)),
    ("pd decode", "decode", dict(mode="pd", prefill={"mode": "dep"}, decode={"mode": "dep"},
                                 max_decode_instances=2), (2, 1)),
]


def measure(label: str, kind: str, deployment: dict, counts: tuple[int, int]) -> None:
    with LLM("tiny", dtype="float32", **deployment) as llm:
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        before = llm.generate([[1, 2, 3, 4]] * 4, sp)
        up, down = counts
        times: dict[int, list[tuple[float, float]]] = {up: [], down: []}
        for n in (up, down) * 6:
            t0 = time.monotonic()
            e = llm.scale(**{kind: n})["events"][-1]
            times[n].append((e["seconds"], e["left_s"] - e["requested_s"]))
            print(f"{label} -> {n}: {e['outcome']}, serving after {e['seconds']:.3f} s, old member gone after "
                  f"{e['left_s'] - e['requested_s']:.3f} s, moved {e['moved_bytes'] / 2**20:.1f} MiB" +
                  (f" in {e['move_s']:.3f} s" if e["move_s"] else "") + f" (call {time.monotonic() - t0:.3f} s)")
        after = llm.generate([[1, 2, 3, 4]] * 4, sp)
        for n, name in ((up, f"up {down} -> {up}"), (down, f"down {up} -> {down}")):
            print(f"{label} {name}: median serving after {statistics.median(s for s, _ in times[n]):.2f} s "
                  f"(min {min(s for s, _ in times[n]):.2f}, max {max(s for s, _ in times[n]):.2f}), old member gone "
                  f"after {statistics.median(x for _, x in times[n]):.2f} s ({len(times[n])} changes)")
        print(f"{label}: greedy outputs after = before:", [o.outputs[0].token_ids for o in after] ==
              [o.outputs[0].token_ids for o in before])


def main(labels: list[str]) -> None:
    """``labels``: the kinds to measure (e.g. "dep ranks"); none: every kind."""
    for kind in KINDS:
        if not labels or kind[0] in labels:
            measure(*kind)


if __name__ == "__main__":
    main(sys.argv[1:])
