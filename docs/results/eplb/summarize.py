"""docs/results/eplb.md from the EPLB comparison and its simulation:

    moeflow bench compare configs/eplb-4proc.yaml --json docs/results/eplb/compare.json --md docs/results/eplb/compare.md
    moeflow simulate --config configs/eplb-4proc.yaml --compare-with docs/results/eplb/compare.json \
        --json docs/results/eplb/sim.json
    python docs/results/eplb/summarize.py
"""
from __future__ import annotations

import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "eplb.md")


def _ci(x: dict | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    if not x:
        return "—"
    lo, hi = x.get("ci95") or x.get("ci") or (None, None)
    m = x["mean"] * scale
    return f"{m:{fmt}} [{lo * scale:{fmt}}, {hi * scale:{fmt}}]" if lo is not None else f"{m:{fmt}}"


def _points(system: dict) -> list[dict]:
    out = []
    for rep in system["repeats"]:
        out += rep["sweep"] + ([rep["saturation"]] if rep.get("saturation") else [])
    return out


def _balance(system: dict) -> tuple[str, str]:
    """(the first measured balancedness, the last): the window's mean over layers."""
    first = system["repeats"][0]["sweep"][0]
    last = system["repeats"][-1]["sweep"][-1]
    rebalances = first.get("eplb_rebalances") or []
    start = rebalances[0]["balancedness_before"] if rebalances else first.get("eplb_balancedness")
    end = last.get("eplb_balancedness")
    return (f"{start:.3f}" if start is not None else "—"), (f"{end:.3f}" if end is not None else "—")


def _latency(system: dict) -> str:
    during, outside = [], []
    for p in _points(system):
        lat = p.get("eplb_latency")
        if lat and lat["ttft_mean_s_during"] is not None and lat["ttft_mean_s_outside"] is not None:
            during.append((lat["requests_during"], lat["ttft_mean_s_during"]))
            outside.append((lat["requests_outside"], lat["ttft_mean_s_outside"]))
    if not during:
        return "no point had requests both during and outside a rebalance"
    nd, no = sum(n for n, _ in during), sum(n for n, _ in outside)
    md = sum(n * t for n, t in during) / nd
    mo = sum(n * t for n, t in outside) / max(no, 1)
    return (f"{nd} requests overlapped a rebalance, mean TTFT {md:.2f} s; {no} did not, {mo:.2f} s "
            f"(the same points; pooled over {len(during)} points)")


def main() -> None:
    with open(os.path.join(HERE, "compare.json")) as f:
        res = json.load(f)
    sim = None
    if os.path.exists(os.path.join(HERE, "sim.json")):
        with open(os.path.join(HERE, "sim.json")) as f:
            sim = json.load(f)
    prov = res["provenance"]
    lines = [f"# {res['title']}", "",
             f"Measured on {prov.get('cpu', '?')} ({prov.get('cores', '?')} cores), dtype {res['dtype']}, commit "
             f"`{prov['commit'][:10]}`{' (dirty)' if prov.get('dirty') else ''}, {res['repeats']} repeats "
             f"(seeds {res['seeds']}), systems interleaved. Command and configuration: "
             f"`{prov.get('command', '')}`; [configs/eplb-4proc.yaml](../../configs/eplb-4proc.yaml). "
             f"Full tables: [eplb/compare.md](eplb/compare.md).", "",
             "| system | mean TTFT at 0.8 rps (s) | saturation prompt tok/s | balancedness first → last | "
             "rebalances | mean move (ms) | slots moved per rebalance |", "|---|---|---|---|---|---|---|"]
    for name, s in res["systems"].items():
        pt = s["points"][0]
        ttft = {"mean": pt["ttft_mean_s"], "ci95": pt.get("ttft_mean_s_ci")}
        first, last = _balance(s)
        reb = (s.get("eplb") or {}).get("rebalances", [])
        move = statistics.mean(r["move_s"] for r in reb) * 1e3 if reb else None
        slots = statistics.mean(r["moved_slots"] for r in reb) if reb else None
        lines.append(f"| {name} | {_ci(ttft)} | {_ci(s['saturation'].get('tok_s'), fmt='.0f')} | {first} → {last} | "
                     f"{len(reb)} | {'—' if move is None else f'{move:.0f}'} | "
                     f"{'—' if slots is None else f'{slots:.1f}'} |")
    lines += ["", "Balancedness: mean / max tokens per expert device over the engine's load window, averaged over "
              "the MoE layers (1 = balanced); *first* is the placement the first point started with, *last* the "
              "window at the end of the last sweep point.", "", "## EPLB on over off", ""]
    for c in res["comparisons"]:
        pr = c["per_rate"][0]
        sat = c.get("saturation_ratio_a_over_b") or {}
        lines.append(f"- **{c['a']} / {c['b']}**: mean TTFT at {pr['rps']:g} rps, {c['b']} over {c['a']}: "
                     f"{_ci(pr['ttft_ratio_b_over_a'], fmt='.3f')} ({pr['verdict']}); saturation throughput "
                     f"{_ci(sat.get('ratio'), fmt='.3f')} ({sat.get('verdict', '—')}).")
    lines += ["", "## What a rebalance costs", ""]
    for name, s in res["systems"].items():
        if (s.get("eplb") or {}).get("live"):
            lines.append(f"- {name}: {_latency(s)}.")
    if sim is not None:
        lines += ["", "## The simulator's prediction", "", _sim_table(sim)]
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _sim_table(sim: dict) -> str:
    rows = ["| system | simulated mean TTFT at 0.8 rps (s) | simulated saturation prompt tok/s |", "|---|---|---|"]
    for name, s in sim.get("systems", {}).items():
        pts = s.get("points") or []
        ttft = next((p.get("ttft_mean_s") for p in pts if abs(p.get("rps", 0) - 0.8) < 1e-9), None)
        sat = (s.get("saturation") or {}).get("tok_s")
        sat = sat.get("mean") if isinstance(sat, dict) else sat
        rows.append(f"| {name} | {'—' if ttft is None else f'{ttft:.2f}'} | {'—' if sat is None else f'{sat:.0f}'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
