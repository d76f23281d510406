"""The elastic-against-fixed table of docs/results/elastic.md from a `moeflow simulate --json` result
of configs/elastic-afd-gb200.yaml (or -decode-gb200, -pd-gb200) (one row per system; with --repeats, the median over the seeds and
their range).

    python docs/results/elastic/sim_table.py docs/results/elastic/sim_gb200.json
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import Counter

from moeflow.experiment.system import system_from_dict


def runs(result: dict) -> list[dict]:
    """Each seed's point (the config has one rate)."""
    reps = result.get("repeats") or [{"sweep": result["points"]}]
    return [r["sweep"][0] for r in reps]


def cell(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return format(med, fmt) if len(values) == 1 else f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main(path: str) -> None:
    with open(path) as f:
        systems = json.load(f)["systems"]
    print("| system | processes, mean | goodput per process-second | within both SLOs | TTFT p90 s | "
          "TPOT p90 ms | membership changes |")
    print("|---|---|---|---|---|---|---|")
    best_fixed = max((statistics.median(p["goodput_per_process_s"] for p in runs(r)), n)
                     for n, r in systems.items() if not r["config"].get("autoscale"))
    for name, r in systems.items():
        ps = runs(r)
        end = [p["process_s"] / max(p["duration_s"], 1e-9) for p in ps]
        print(f"| {name} | {cell(end, '.1f')} | {cell([p['goodput_per_process_s'] for p in ps], '.4f')} | "
              f"{cell([p['slo_attainment'] for p in ps], '.0%')} | {cell([p['ttft_p90_s'] for p in ps], '.2f')} | "
              f"{cell([p['tpot_p90_s'] * 1e3 for p in ps], '.0f')} | "
              f"{cell([len(p.get('membership_changes', [])) for p in ps], 'd')} |")
    print(f"\nbest fixed by median goodput per process-second: {best_fixed[1]} ({best_fixed[0]:.4f})")
    for name, r in systems.items():
        for k, p in enumerate(runs(r)):
            if p.get("membership_changes"):
                reasons = Counter(f"{c['side']} {'up' if c['after'] > c['before'] else 'down'} ({c['reason']})"
                                  for c in p["membership_changes"])
                print(f"{name}, seed {k}: " + ", ".join(f"{n} x {why}" for why, n in sorted(reasons.items())))
                cfg, n_best = r["config"], _processes(systems[best_fixed[1]]["config"])
                above = _above(_processes(cfg), p["membership_changes"], p["duration_s"], n_best, _per_member(cfg))
                print(f"    process-seconds above {best_fixed[1]}'s {n_best} processes: {above:.0f} of "
                      f"{p['process_s']:.0f} ({above / p['process_s']:.0%})")


def _layout(cfg: dict):
    return system_from_dict("x", {k: v for k, v in cfg.items()
                                  if k not in ("name", "model", "dtype", "hardware", "cost", "devices")}).layout


def _processes(cfg: dict) -> int:
    return _layout(cfg).num_processes


def _per_member(cfg: dict) -> dict[str, int]:
    """Processes per member of each side that changes (a pd instance is its layout's processes)."""
    lay = _layout(cfg)
    return {"prefill": lay.prefill.num_processes, "decode": lay.decode.num_processes} if lay.mode == "pd" else {}


def _above(start: int, changes: list[dict], end_s: float, n: int, per_member: dict[str, int]) -> float:
    """Process-seconds spent above ``n`` processes: a joiner counts from the ask, a leaver to its exit
    (``done_s``), as the simulator's own accounting."""
    def d(c: dict) -> int:
        return (c["after"] - c["before"]) * per_member.get(c["side"], 1)
    steps = sorted([(c["asked_s"], d(c)) for c in changes if c["after"] > c["before"]]
                   + [(c["done_s"], d(c)) for c in changes if c["after"] < c["before"]])
    total, t, members = 0.0, 0.0, start
    for at, d in steps + [(end_s, 0)]:
        total += max(0, members - n) * (min(at, end_s) - t)
        t, members = min(at, end_s), members + d
    return total


if __name__ == "__main__":
    main(sys.argv[1])
