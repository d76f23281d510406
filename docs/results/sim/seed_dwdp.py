"""DWDP's rows of the seed tables (``seed_tables.py``): configs/dwdp-gb200.yaml's results, the runs
``seed_runs.py`` makes, and the end-to-end Pareto of configs/dwdp-e2e-gb200.yaml."""
from __future__ import annotations

import json

from moeflow.experiment.serve import load_experiment
from moeflow.sim.run import build_cost

import seed_splits as sp  # noqa: E402  (beside this script)
from seed_common import _load, row, verdict  # noqa: E402
from seed_runs import caption_workload_spread, fig1_sync_overhead, table3b, table3d, table4_text  # noqa: E402

E2E = "docs/results/dwdp/e2e_gb200.json"


def dwdp_rows() -> list[str]:
    d = _load("dwdp_gb200")
    pts = d["roofline"]["dwdp4"]["points"]
    cross = next((a["isl"] * (b["isl"] / a["isl"]) ** ((1 - a["hidden"]) / (b["hidden"] - a["hidden"]))
                  for a, b in zip(pts, pts[1:]) if a["hidden"] < 1 <= b["hidden"]), None)
    out = [row("Fig. 3: compute hides the pull from ISL", "~16K", f"{cross / 1024:.1f}K" if cross else "none",
               verdict(cross, 16384), sp.roofline_split(pts, (12288, 16384)))]
    cfg = load_experiment("configs/dwdp-gb200.yaml")
    cost = build_cost(cfg)
    copy = cost.device_copy_s(cost.model.num_experts * cost.model.expert_bytes) * 1e6
    out.append(row("Table 1: the merge's D2D copy of a layer's experts (baseline DWDP)", "34.00 µs", f"{copy:.1f} µs",
                   verdict(copy, 34.0), sp.copy_split(cost)))
    for what, paper in (("Table 3a: DWDP4 / DEP4 TTFT speed-up, ISL 1K-32K", "1.11-1.27"),
                        ("Table 3b: DWDP4 / DEP4 TTFT speed-up over MNT", "1.07-1.16")):
        out.append(row(what, paper, "not simulated (the paper's median TTFT includes queueing under an arrival "
                       "process it does not give; under the sweeps' reading, every request at once, a median TTFT's "
                       "ratio is the throughput's: not a prediction of its own)", "-"))
    (_, r3, s3), (_, r4, _) = table3d()
    out.append(row("Table 3d: DWDP3 / DEP3 against DWDP4 / DEP4 TPS/GPU, ISL 16K, MNT 32K", "nearly equal (1)",
                   f"{r3:.3f} / {r4:.3f} = {r3 / r4:.3f}", verdict(r3 / r4, 1.0), s3))
    for p in d["sweeps"]["isl"]:
        r = p["dwdp4"]["tok_s_per_device"] / p["dep4_dedup"]["tok_s_per_device"]
        out.append(row(f"Table 3a: DWDP4 / DEP4 TPS/GPU, ISL {p['value'] // 1024}K", "1.09-1.11", f"{r:.3f}",
                       verdict(r, 1.09, 1.11), sp.dwdp_point(p)))
        if p["value"] == 8192:
            busy = p["dep4_dedup"]["sim_busy"]["rank"]
            out.append(row("Table 1: DEP4 time not computing (sync + comm), ISL 8K", "21.86%", f"{(1 - busy) * 100:.1f}%",
                           verdict(1 - busy, 0.2186), sp.dwdp_point(p)))
            net = 1 - p["dep4_dedup"]["tok_s_per_device"] / p["dwdp4"]["tok_s_per_device"]
            out.append(row("Table 1: net iteration reduction, ISL 8K", "11.69%", f"{net * 100:.1f}%", verdict(net, 0.1169),
                           sp.dwdp_point(p)))
            if "dwdp4_local" in p:
                r = p["dwdp4_local"]["tok_s_per_device"] / p["dep4_dedup"]["tok_s_per_device"]
                out.append(row("§2: more local experts when memory allows, ISL 8K", "-", f"{r:.3f}", "-"))
    std = d["sweeps"].get("isl_std", [])
    if std:
        lo, hi = (p["dwdp4"]["tok_s_per_device"] / p["dep4_dedup"]["tok_s_per_device"] for p in (std[0], std[-1]))
        out.append(row(f"Table 3c: DWDP4 / DEP4 at length std {std[0]['value']}", "1.08", f"{lo:.3f}", verdict(lo, 1.08),
                       sp.dwdp_point(std[0])))
        out.append(row(f"Table 3c: the same at std {std[-1]['value']}", "1.15", f"{hi:.3f}", verdict(hi, 1.15),
                       sp.dwdp_point(std[-1])))
    spread, caption_wait = caption_workload_spread()
    for cv, paper in ((0.0, None), (0.2, 12.0)):
        wait, still = fig1_sync_overhead(cv) * 100, fig1_sync_overhead(cv, steady=True) * 100
        out.append(row(f"Fig. 1: DEP4 sync overhead, per-rank length CV {cv:.0%} (ISL 8K)",
                       f"~{paper:.0f}%" if paper else "-", f"{wait:.1f}%", verdict(wait, paper) if paper else "-",
                       f"{still:.1f}% with compute jitter and expert skew off (the lengths alone); on the caption's "
                       f"workload (ratio 0.8, MNT 32K) the ranks' tokens vary {spread:.1%} (CV) and a rank waits "
                       f"{caption_wait:.1%}"))
    for mnt, r, split in table3b():
        out.append(row(f"Table 3b: DWDP4 / DEP4 TPS/GPU, ISL 8K, MNT {mnt // 1024}K", "1.01-1.10", f"{r:.3f}",
                       verdict(r, 1.01, 1.10), split))
    (_, naive, s_naive), (_, full, s_full) = table4_text()
    out.append(row("Table 4 (text): DWDP without the contention fix / DEP4, ISL 8K ratio 0.5, MNT 16K",
                   "slightly below 1 (read: 0.85-1)", f"{naive:.3f}", "within" if 0.85 <= naive < 1 else "MISS",
                   s_naive))
    out.append(row("Table 4 (text): the same with it (DWDP4 / DEP4)", "significantly above 1 (read: > 1)",
                   f"{full:.3f}", "within" if full > 1 else "MISS", s_full))
    return out + e2e_rows()


def e2e_rows() -> list[str]:
    """§5.3, the disaggregated Pareto (configs/dwdp-e2e-gb200.yaml; docs/results/dwdp/e2e_gb200.md)."""
    with open(E2E) as f:
        d = json.load(f)
    r, ctx = d["ratios"]["dwdp4"], d["context"]
    split = (f"one context instance: DWDP4 {ctx['dwdp4']['rps']:.2f} requests/s, DEP4 {ctx['dep4']['rps']:.2f} "
             f"({ctx['dwdp4']['rps'] / ctx['dep4']['rps']:.2f}x); fewer context GPUs per generation server")
    flat = ("the fronts are flat there: DEP's first four points move "
            f"{_drop(d['fronts']['dep4'][:4]):.0%} in TPS/GPU")
    ttft = r["ttft_p50_range_s"]
    return [row("§5.3 Table 5: output TPS/GPU at equal TPS/user, 20-30 TPS/user", "1.10",
                f"{r['tps_per_device_band']['mean']:.3f}", verdict(r["tps_per_device_band"]["mean"], 1.10), split),
            row("§5.3: the same over 20-100 TPS/user", "1.088", f"{r['tps_per_device_range']['mean']:.3f}",
                verdict(r["tps_per_device_range"]["mean"], 1.088), split),
            row("§5.3: TPS/user at equal output TPS/GPU, 20-30 TPS/user", "1.15", f"{r['tps_user_band']['mean']:.2f}",
                verdict(r["tps_user_band"]["mean"], 1.15), flat),
            row("Table 6: median TTFT, DWDP against DEP, 20-100 TPS/user", "higher", f"{ttft['dwdp4']:.2f} s vs "
                f"{ttft['dep4']:.2f} s", "within" if ttft["dwdp4"] > ttft["dep4"] else "MISS",
                "DWDP's fewer context instances run closer to the 90% cap")]


def _drop(front: list) -> float:
    """How much a front's output TPS/GPU falls over its points (TPS/user, TPS/GPU), as a share."""
    return 1 - front[-1][1] / front[0][1]
