"""Why no A:F ratio meets the TPOT SLO in configs/elastic-afd-gb200.yaml (docs/results/elastic.md):
each fixed system's steps split by whether any instance's micro-batch carries a prompt chunk (more
than one token of a request), with their count and median duration.

    python docs/results/elastic/sim_split.py > docs/results/elastic/sim_split.txt
"""
from __future__ import annotations

import statistics

from moeflow.experiment.serve import load_experiment
from moeflow.measure.provenance import provenance
from moeflow.measure.workload import generate_requests
from moeflow.sim.run import build_cost, make_system

CONFIG = "configs/elastic-afd-gb200.yaml"


def main() -> None:
    cfg = load_experiment(CONFIG)
    cost = build_cost(cfg)
    prov = provenance()
    print(f"{CONFIG}, seed {cfg.workload.seed}, base rate {cfg.rps[0]} rps; commit {prov['commit'][:7]}"
          f"{' (dirty)' if prov['dirty'] else ''}; analytic costs (no machine enters the numbers)")
    for name, spec in cfg.systems.items():
        if spec.autoscale:
            continue
        sim = make_system(spec, cost)
        sim.step_log = []
        sim.run(generate_requests(cfg.point_workload(cfg.rps[0], cfg.workload.seed)))
        starts = [s for s, _, _ in sim.step_log] + [sim.loop.now]
        kinds = {"with a prompt chunk": [], "decode only": []}
        for (start, works, _), end in zip(sim.step_log, starts[1:]):
            chunk = any(s.num_tokens > 1 for w in works for b in w.batches for s in b.seqs)
            kinds["with a prompt chunk" if chunk else "decode only"].append(end - start)
        total = sum(len(v) for v in kinds.values())
        print(f"{name}: {total} steps; " + "; ".join(
            f"{k} {len(v)} ({len(v) / total:.0%}), median {statistics.median(v) * 1e3:.1f} ms"
            for k, v in kinds.items() if v))


if __name__ == "__main__":
    main()
