"""How far to trust an answer: the simulator's measured error on the validated case closest to the
plan's pick, from ``accuracy.json`` (written by ``docs/results/plan/accuracy.py`` from the committed
seed tables, production anchor and this machine's validation)."""
from __future__ import annotations

import json
import os

_PATH = os.path.join(os.path.dirname(__file__), "accuracy.json")


def _load() -> dict:
    with open(_PATH) as f:
        return json.load(f)


def modes_of(layout: dict) -> list[str]:
    """The modes a deployment runs: its own, or a pd pair's two sides'."""
    if layout.get("mode") == "pd":
        return [layout["prefill"]["mode"], layout["decode"]["mode"]]
    return [layout["mode"]]


def closest(layout: dict, profiled: bool) -> list[str]:
    """Lines naming the measured error of the cases closest to ``layout``: on this machine's profile,
    this machine's validation; on a preset, each of its modes' seed table (dep: the production
    anchor, every seed's baselines being dep too)."""
    a = _load()
    if profiled:
        h = a["here"]
        lo, hi = h["tau_interval"]
        r0, r1 = h["measured_over_predicted"]
        return [f"ranking: Kendall's tau {h['tau']:+.2f} [{lo:+.2f}, {hi:+.2f}] over {h['deployments']} deployments "
                f"measured, the top pick {'measured best' if h['top_pick_best'] else 'not the measured best'}; "
                f"SLO rate measured {r0:.2f}-{r1:.2f}x of the predicted ({h['source']})"]
    out = []
    for mode in dict.fromkeys(modes_of(layout)):
        if mode == "dep":
            r = a["anchor"]["ratio"]
            out.append("dep: simulated / published throughput " + ", ".join(
                f"{phase} {lo:.2f}x" if lo == hi else f"{phase} {lo:.2f}-{hi:.2f}x" for phase, (lo, hi) in sorted(r.items()))
                + f" ({a['anchor']['source']})")
        elif mode in a["seeds"]:
            s = a["seeds"][mode]
            out.append(f"{mode}: {s['within']} of {s['compared']} of the paper's results within tolerance ({s['source']})")
    return out
