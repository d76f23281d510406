"""Saturation sweeps (one workload field varied at a time, every system's prompt tokens/s per device
at ``saturation_rps`` in the steady middle of the run, the config's pairs as ratios) and DWDP §3's per-layer roofline: the tables
DWDP reports (Fig. 3, Table 3a/3c), from one experiment file."""
from __future__ import annotations

import dataclasses

from moeflow.sim.dwdp import crossover, layer_roofline
from moeflow.sim.run import run_point


STEADY = (0.1, 0.9)  # the middle of a saturation run: no start-up (ranks idle or on a lone first request) or drain


def steady_tok_s(records, window: tuple[float, float] = STEADY) -> float:
    """Prompt tokens/s between the first tokens of the requests at the window's quantiles."""
    done = sorted((r.first_token_s, r.prompt_len) for r in records)
    t_a, t_b = (done[min(len(done) - 1, int(q * len(done)))][0] for q in window)
    if t_b <= t_a:
        raise ValueError(f"saturation sweep: {len(done)} requests are too few for a steady window")
    # batches finish their requests together: count what finished after t_a's batch, up to t_b's
    return sum(n for t, n in done if t_a < t <= t_b) / (t_b - t_a)


def run_sweeps(cfg, cost, names: list[str]) -> dict:
    """{field: [{"value": v, system: {...}, "ratios": {"a/b": r}}]} and a printed table per field."""
    pairs = [(a, b) for a, b in cfg.compare if a in names and b in names]
    out = {}
    for field, values, others in cfg.sweeps:
        rows = []
        for v in values:
            point_cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **dict(others), **{field: v}))
            row = {"value": v}
            for n in names:
                p, res = run_point(cfg.systems[n], cost, point_cfg, cfg.saturation_rps)
                devices = cfg.systems[n].layout.num_processes
                row[n] = {"tok_s_per_device": steady_tok_s(res.records) / devices,
                          "run_tok_s_per_device": p["prefill_tok_s"] / devices, "ttft_mean_s": p["ttft_mean_s"],
                          "completed": p["completed"], "sim_busy": p["sim_busy"]}
                if "sim_split" in p:  # dep: what a rank does when it does not compute (all-to-all, barrier wait)
                    row[n]["sim_split"] = p["sim_split"]
            row["ratios"] = {f"{a}/{b}": row[a]["tok_s_per_device"] / row[b]["tok_s_per_device"] for a, b in pairs}
            rows.append(row)
        out[field] = rows
        print(f"\nsaturation sweep over {field} at {cfg.saturation_rps:g} rps: prompt tokens/s per device")
        print(f"{field:>10} " + " ".join(f"{n:>12}" for n in names) + " " + " ".join(f"{k:>20}" for k in rows[0]["ratios"]))
        for r in rows:
            print(f"{r['value']:>10} " + " ".join(f"{r[n]['tok_s_per_device']:>12,.0f}" for n in names) + " "
                  + " ".join(f"{x:>20.3f}" for x in r["ratios"].values()))
    return out


def run_roofline(cfg, cost, names: list[str]) -> dict:
    """Per DWDP group size among the systems: T_compute / T_prefetch and T_DEP / T_DWDP per layer at batch 1, and where each crosses 1."""
    out = {}
    for dp in sorted({cfg.systems[n].layout.dp for n in names if cfg.systems[n].layout.mode == "dwdp"}):
        n = f"dwdp{dp}"  # copy plan and merge do not enter the roofline: one table per group size
        pts = [layer_roofline(cost, dp, isl) for isl in cfg.roofline_isl]
        out[n] = {"points": [{**dataclasses.asdict(p), "hidden": p.hidden, "speedup": p.speedup} for p in pts],
                  "crossover_hidden_isl": crossover(pts, "hidden"), "crossover_speedup_isl": crossover(pts, "speedup")}
        print(f"\nDWDP{dp} vs DEP{dp} per layer, batch 1 (DWDP §3, Fig. 3)")
        print(f"{'ISL':>8} {'compute ms':>11} {'prefetch ms':>12} {'all2all ms':>11} {'Tc/Tp':>7} {'DEP/DWDP':>9}")
        for p in pts:
            print(f"{p.isl:>8} {p.compute_s * 1e3:>11.2f} {p.prefetch_s * 1e3:>12.2f} {p.all2all_s * 1e3:>11.2f} "
                  f"{p.hidden:>7.2f} {p.speedup:>9.3f}")
        c1, c2 = out[n]["crossover_hidden_isl"], out[n]["crossover_speedup_isl"]
        fmt = lambda x: f"{x:,.0f}" if x else "none in range"  # noqa: E731
        print(f"prefetch hidden from ISL {fmt(c1)}; DWDP ahead of DEP from ISL {fmt(c2)}")
    return out
