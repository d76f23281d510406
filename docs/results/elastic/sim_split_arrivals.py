"""Where an elastic system's goodput goes against a fixed one's (docs/results/elastic.md): each system's
requests of one seed by when they arrived, per bucket their count, the share within both SLOs, the
median TPOT and the median wait for an instance (arrival to first batch), and the elastic system's
membership at the bucket's start.

    python docs/results/elastic/sim_split_arrivals.py CONFIG SYSTEM... > OUT.txt
"""
from __future__ import annotations

import statistics
import sys

from moeflow.experiment.serve import load_experiment
from moeflow.measure.provenance import provenance
from moeflow.sim.run import build_cost, run_point

BUCKET_S = 50.0


def membership(changes: list[dict], start: tuple[int, int], t: float) -> tuple[int, int]:
    """(instances, daemons) serving at ``t``: every change done by then."""
    a, f = start
    for c in sorted(changes, key=lambda c: c["done_s"]):
        if c["done_s"] <= t:
            a, f = (c["after"], f) if c["side"] == "attention" else (a, c["after"])
    return a, f


def main(config: str, names: list[str]) -> None:
    cfg = load_experiment(config)
    cost, prov, seed = build_cost(cfg), provenance(), cfg.workload.seed
    slo_ttft, slo_tpot = cfg.goodput_slo
    print(f"{config}, seed {seed}, base rate {cfg.rps[0]} rps; commit {prov['commit'][:7]}"
          f"{' (dirty)' if prov['dirty'] else ''}; {cfg.target.cost} costs")
    for name in names:
        spec = cfg.systems[name]
        p, res = run_point(spec, cost, cfg, cfg.rps[0], seed)
        start = (spec.layout.attn_workers, spec.layout.ffn_workers)
        print(f"== {name}: {p['goodput_per_process_s']:.4f} good requests per process-second, "
              f"{p['process_s']:.0f} process-seconds, {p['duration_s']:.0f} s")
        print("  arrived      count  within  TPOT p50 ms  wait p50 s  members at start (A:F)")
        last = max(r.arrival_s for r in res.records)
        for lo in range(0, int(last // BUCKET_S) + 1):
            t0 = lo * BUCKET_S
            rs = [r for r in res.records if t0 <= r.arrival_s < t0 + BUCKET_S]
            if not rs:
                continue
            ok = sum(1 for r in rs if r.ttft_s <= slo_ttft and (r.tpot_s is None or r.tpot_s <= slo_tpot))
            tpot = statistics.median(r.tpot_s for r in rs if r.tpot_s is not None) * 1e3
            wait = statistics.median(r.first_scheduled_s - r.arrival_s for r in rs)
            a, f = membership(p.get("membership_changes", []), start, t0)
            print(f"  {t0:5.0f}-{t0 + BUCKET_S:<5.0f} {len(rs):6d} {ok / len(rs):6.0%} {tpot:12.0f} {wait:11.2f}  {a}:{f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
