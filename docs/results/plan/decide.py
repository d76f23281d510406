"""Whether moeflow plan's ranking holds when measured: a validation that can decide (docs/plan.md).

    python docs/results/plan/decide.py [DIR]   # DIR: docs/results/plan/decide

Reads DIR/plan.json (the plan), DIR/measured.json (``bench compare configs/plan-decide-4proc.yaml``,
every repeat's SLO rate bisected) and DIR/simulated.json (``simulate --compare-with`` of that run)
and writes DIR/README.md's tables: per deployment the plan's predicted SLO rate, every repeat's
measured one (the highest rate that met p90 TTFT <= SLO below the lowest that missed it) and the
error; Kendall's tau-b between the predicted and the measured medians with a bootstrap interval
(each deployment's repeats resampled with replacement, 10,000 draws, seed 0); whether the plan's top
pick is the measured best or within the best's interval; and the simulator's error at every
measured point (mean TTFT, TPOT, output tokens/s, KV handoff), inside the measured 95% interval or not.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the bench compare systems and the plan candidates they are
SYSTEMS = {"pd_3xdep1_1xdep1": "pd_dep1_dep1", "pd_1xasap_d2e1_1xdep1": "pd_asap_d2e1_dep1",
           "pd_1xasap_d1e1_1xafd_1a1f": "pd_asap_d1e1_afd_1a1f"}
DRAWS = 10_000


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b (ties in either list count as neither concordant nor discordant)."""
    conc = disc = tx = ty = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def repeat_rates(system: dict, metric: str) -> list[float]:
    """Each repeat's measured SLO rate (a repeat no rate met counts as 0; one that met every rate
    probed counts at its bound, marked in the table)."""
    out = []
    for rep in system["repeats"]:
        s = rep["slo"][metric]
        out.append(s["rps"] if s["rps"] is not None else (s.get("at_least_rps") or 0.0))
    return out


def bootstrap(measured: dict[str, list[float]], predicted: dict[str, float], rng: random.Random):
    names = list(measured)
    pred = [predicted[n] for n in names]
    taus, best = [], {n: 0 for n in names}
    for _ in range(DRAWS):
        med = {n: statistics.median(rng.choices(v, k=len(v))) for n, v in measured.items()}
        taus.append(kendall_tau_b(pred, [med[n] for n in names]))
        best[max(names, key=lambda n: med[n])] += 1
    taus.sort()
    return taus[int(0.025 * DRAWS)], taus[int(0.975 * DRAWS) - 1], {n: c / DRAWS for n, c in best.items()}


def median_interval(values: list[float], rng: random.Random) -> tuple[float, float]:
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(DRAWS))
    return meds[int(0.025 * DRAWS)], meds[int(0.975 * DRAWS) - 1]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def point_rows(simulated: dict) -> tuple[list[str], dict]:
    rows, tally = [], {}
    for name, c in simulated["comparison"].items():
        for p in c["points"]:
            cells = [f"{_pct(p['error'])}{'' if p.get('within_ci', True) else ' (out)'}"]
            tally.setdefault("ttft", []).append(p.get("within_ci"))
            for key in ("tpot_mean_s", "output_tok_s", "handoff_mean_s"):
                q = p.get(key)
                cells.append("-" if q is None else f"{_pct(q['error'])}{'' if q.get('within_ci', True) else ' (out)'}")
                if q is not None:
                    tally.setdefault(key, []).append(q.get("within_ci"))
            rows.append(f"| {name} | {p['rps']:g} | {p['measured_ttft_s']:.3f} | {p['simulated_ttft_s']:.3f} | "
                        + " | ".join(cells) + " |")
    return rows, tally


def main(d: str) -> str:
    with open(os.path.join(d, "plan.json")) as f:
        plan = {c["name"]: c for c in json.load(f)["candidates"]}
    with open(os.path.join(d, "measured.json")) as f:
        run = json.load(f)
    with open(os.path.join(d, "simulated.json")) as f:
        simulated = json.load(f)
    metric = run["slo_metric"]
    predicted = {n: plan[c]["slo_rps"] for n, c in SYSTEMS.items()}
    measured = {n: repeat_rates(run["systems"][n], metric) for n in SYSTEMS}
    rng = random.Random(0)
    med = {n: statistics.median(v) for n, v in measured.items()}
    ivl = {n: median_interval(v, rng) for n, v in measured.items()}
    names = sorted(SYSTEMS, key=lambda n: -predicted[n])
    top, best = names[0], max(SYSTEMS, key=lambda n: med[n])
    tau = kendall_tau_b([predicted[n] for n in names], [med[n] for n in names])
    lo, hi, p_best = bootstrap(measured, predicted, rng)
    lines = [f"| deployment | plan's SLO rps | measured per repeat | median [95% bootstrap] | measured / predicted |",
             "|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {predicted[n]:.2f} | {', '.join(f'{v:.2f}' for v in measured[n])} | "
                     f"{med[n]:.2f} [{ivl[n][0]:.2f}, {ivl[n][1]:.2f}] | {med[n] / predicted[n]:.2f} |")
    top_ok = top == best or ivl[top][1] >= ivl[best][0]
    lines += ["", f"Kendall's tau-b, predicted against measured medians: {tau:+.2f}, 95% bootstrap interval "
              f"[{lo:+.2f}, {hi:+.2f}] ({'excludes' if lo > 0 or hi < 0 else 'includes'} 0).",
              f"The plan's top pick ({top}) is {'the measured best' if top == best else f'not the measured best ({best})'}"
              + ("" if top == best else f"; {'tied with it within the intervals' if top_ok else 'outside its interval'}")
              + f"; share of bootstrap draws in which each is best: "
              + ", ".join(f"{n} {p_best[n]:.0%}" for n in names) + ".", "",
              "The simulator at every measured point (error of the simulated mean against the measured mean; "
              "`(out)`: outside the measured 95% interval over the repeats):", "",
              "| deployment | rps | measured TTFT s | simulated TTFT s | TTFT | TPOT | output tok/s | KV handoff |",
              "|---|---|---|---|---|---|---|---|"]
    rows, tally = point_rows(simulated)
    lines += rows + ["", "Inside the measured interval: " + ", ".join(
        f"{k.replace('_mean_s', '').replace('_s', '')} {sum(bool(v) for v in vs)} of {len(vs)}" for k, vs in tally.items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "decide")))
