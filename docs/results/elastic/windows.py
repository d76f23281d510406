"""The load windows the controller decided on, measured (a ``moeflow serve --autoscale`` log at
MOEFLOW_LOGGING_LEVEL=DEBUG) beside simulated (``moeflow simulate --json``'s ``autoscale_windows``) on
the same requests: when each saw TPOT or TTFT cross its SLO, and what it did.

    python docs/results/elastic/windows.py MEASURED.json SIM.json SEED [SYSTEM]

MEASURED.json: measured.py's, whose run names its server's log and the workload's start on the server's
clock; times are from the workload's start in both.
"""
from __future__ import annotations

import json
import re
import sys

FIELD = re.compile(r"(\w+)=([^,)]+)")


def measured(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if "autoscale: window Sample(" in line:
                w = {k: (None if v == "None" else float(v)) for k, v in FIELD.findall(line.split("Sample(", 1)[1])}
                rows.append(w)
            elif "autoscale: " in line and " -> attention " in line:
                rows.append({"decision": line.split("autoscale: ", 2)[-1].split(" (predicted")[0]})
    return rows


def main(measured_json: str, sim_json: str, seed: str, system: str = "elastic") -> None:
    with open(measured_json) as f:
        run = next(r for r in json.load(f)["runs"] if r["system"] == system and r["seed"] == int(seed))
    rows, t0 = measured(run["log"]), run["t0_s"]
    with open(sim_json) as f:
        sim_result = json.load(f)["systems"][system]
    point = (sim_result.get("repeats") or [{"sweep": sim_result["points"]}])[int(seed)]["sweep"][0]
    sim = {round(w["t_s"]): w for w in point.get("autoscale_windows", [])}
    print("t s | measured: members, TPOT p90 ms, TTFT p90 s, queue | simulated: members, TPOT p90 ms, TTFT p90 s, queue")
    for r in rows:
        if "decision" in r:
            print(f"      measured decision: {r['decision']}")
            continue
        t = r["t_s"] - t0
        s = sim.get(min(sim, key=lambda k: abs(k - t))) if sim else None
        print(f"{t:5.0f} | {_row(r)} | {_row(s) if s else '-'}")
    for c in point.get("membership_changes", []):
        print(f"      simulated decision at {c['asked_s']:.0f} s: {c['reason']} -> {c['side']} {c['after']}")


def _row(w: dict) -> str:
    tp = "-" if w["tpot_p90_s"] is None else f"{1e3 * w['tpot_p90_s']:.0f}"
    tt = "-" if w["ttft_p90_s"] is None else f"{w['ttft_p90_s']:.2f}"
    return f"{int(w['attention'])}:{int(w['ffn'])}, {tp}, {tt}, {int(w['queue'])}"


if __name__ == "__main__":
    main(*sys.argv[1:])
