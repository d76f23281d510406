"""moeflow plan's predicted order against the measured one (docs/plan.md, "Validated here").

    python docs/results/plan/validate.py [OUT.md]

Reads the plan (tiny_cpu_here_4.json) and the bench compare run of its picks (validate_4proc.json,
configs/plan-validate-4proc.yaml) and writes validate.md: per system, the simulated SLO rate, and
per measured repeat the highest rate whose p90 TTFT and p90 TPOT are both within the bounds, below
the first rate that misses (the measured SLO rate is bracketed by the rate grid: [that rate, the
next]); then whether the measured order is the predicted one.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the bench compare systems and the plan candidates they are
SYSTEMS = {"pd_1xdwdp2_1xdep1": "pd_dwdp2_dep1", "pd_2xdep1_1xdep1": "pd_dep1_dep1",
           "pd_2xdep1_1xdep2": "pd_dep1_dep2", "dep4": "dep4"}


def meets(p: dict, ttft_s: float, tpot_s: float) -> bool:
    ttft, tpot = p.get("ttft_p90_s"), p.get("tpot_p90_s")
    return p.get("completed", 0) > 0 and ttft is not None and ttft <= ttft_s and tpot is not None and tpot <= tpot_s


def measured_bracket(points: list[dict], ttft_s: float, tpot_s: float) -> tuple[float | None, float | None]:
    """(highest rate met below the first missed, that first missed rate); None where there is none."""
    ok = None
    for p in sorted(points, key=lambda p: p["rps"]):
        if not meets(p, ttft_s, tpot_s):
            return ok, p["rps"]
        ok = p["rps"]
    return ok, None


def main(out_path: str) -> None:
    with open(os.path.join(HERE, "tiny_cpu_here_4.json")) as f:
        plan = {c["name"]: c for c in json.load(f)["candidates"]}
    with open(os.path.join(HERE, "validate_4proc.json")) as f:
        run = json.load(f)
    ttft_s, tpot_s = run["slo_ttft_s"], run["slo_tpot_s"]
    rates = sorted({p["rps"] for s in run["systems"].values() for rep in s["repeats"] for p in rep["sweep"]})
    rows, predicted, measured = [], {}, {}
    for name, cand in SYSTEMS.items():
        c = plan[cand]
        predicted[name] = c["slo_rps"]
        brackets = [measured_bracket(rep["sweep"], ttft_s, tpot_s) for rep in run["systems"][name]["repeats"]]
        lows = sorted(b[0] or 0.0 for b in brackets)
        measured[name] = lows[len(lows) // 2]
        text = ", ".join(f"[{lo if lo is not None else '<' + str(min(rates))}, "
                         f"{hi if hi is not None else '>'}]" for lo, hi in brackets)
        rows.append(f"| {name} | {'~' if c.get('estimated') else ''}{c['slo_rps']:.3g} | {text} | {measured[name]:g} |")
    by_pred = sorted(SYSTEMS, key=lambda n: -predicted[n])
    by_meas = sorted(SYSTEMS, key=lambda n: -measured[n])
    pairs = [(a, b) for i, a in enumerate(by_pred) for b in by_pred[i + 1:]]
    agree = sum(measured[a] >= measured[b] for a, b in pairs)
    ties = sum(measured[a] == measured[b] for a, b in pairs)
    lines = ["| system | simulated SLO rps | measured per repeat: [met, missed] rps | measured median |",
             "|---|---|---|---|", *rows, "",
             f"Predicted order: {' > '.join(by_pred)}.",
             f"Measured order (median of the repeats' met rates): {' >= '.join(by_meas)}.",
             f"Pairs in the predicted order: {agree} of {len(pairs)} ({ties} tied on the rate grid "
             f"{rates})."]
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "validate.md"))
