"""The DWDP results the seed tables compute themselves (``seed_tables.py``): runs of
configs/dwdp-gb200.yaml's systems at one workload each, outside its sweeps."""
from __future__ import annotations

import dataclasses
import statistics

from moeflow.experiment.serve import load_experiment
from moeflow.measure.workload import generate_requests
from moeflow.sim.run import build_cost, make_system, run_point
from moeflow.sim.sweep import steady_tok_s

import seed_splits as sp  # noqa: E402  (beside this script)


def _dwdp_cfg(**workload):
    cfg = load_experiment("configs/dwdp-gb200.yaml")
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **workload))


def fig1_sync_overhead(cv: float, n: int = 400, steady: bool = False) -> float:
    """DEP4 (DeepEP layout) with one prompt per rank and step, lengths Normal(8K, cv·8K): the share of
    a rank's time spent waiting at the layers' barriers (DWDP Fig. 1's synchronisation overhead);
    ``steady``: with no compute jitter and no expert skew, the lengths the only spread."""
    cfg = _dwdp_cfg(kind="normal", isl=8192, isl_std=round(cv * 8192), num_requests=n)
    spec = cfg.systems["dep4_dedup"]
    spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, max_num_seqs=1))
    if steady:
        spec = dataclasses.replace(spec, sim=dataclasses.replace(spec.sim, compute_jitter_cv=0.0, expert_load_cv=0.0))
    sim = make_system(spec, build_cost(cfg))
    sim.run(generate_requests(dataclasses.replace(cfg.workload, rate_rps=cfg.saturation_rps)))
    return sim.split_s["wait"] / sum(sim.split_s.values())


def caption_workload_spread() -> tuple[float, float]:
    """DEP4 (DeepEP layout) on Fig. 1's stated workload (ISL 8K, ratio 0.8, MNT 32K; the Table 3a point):
    the median over steps of the ranks' prompt-token CV, and the share of a rank's time at barriers."""
    cfg = _dwdp_cfg(isl=8192, num_requests=1536)
    sim = make_system(cfg.systems["dep4_dedup"], build_cost(cfg))
    sim.step_log = []
    sim.run(generate_requests(dataclasses.replace(cfg.workload, rate_rps=cfg.saturation_rps)))
    cvs = []
    for _, works, _ in sim.step_log:
        tokens = [sum(s.num_tokens for b in w.batches for s in b.seqs) for w in works]
        if len(tokens) == cfg.systems["dep4_dedup"].layout.dp and all(tokens):
            cvs.append(statistics.pstdev(tokens) / statistics.mean(tokens))
    return statistics.median(cvs), sim.split_s["wait"] / sum(sim.split_s.values())


def _ratio(cfg, cost, a: str, b: str, **layout) -> tuple[float, str]:
    """System ``a``'s prompt tokens/s per device over ``b``'s at saturation (the steady middle of the
    run), both layouts changed by ``layout``, and the pair's split."""
    tok, split, dp = {}, {}, None
    for n in (a, b):
        spec = cfg.systems[n]
        spec = dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, **layout))
        p, res = run_point(spec, cost, cfg, cfg.saturation_rps)
        tok[n] = steady_tok_s(res.records) / spec.layout.num_processes
        split[n], dp = {k: p[k] for k in ("sim_busy", "sim_split") if k in p}, spec.layout.dp
    return tok[a] / tok[b], sp.dwdp_point(split, b, a, dp)


def table3b() -> list[tuple[int, float, str]]:
    """DWDP4 over DEP4 (DeepEP layout) at ISL 8K, ratio 0.8, as MNT (tokens per rank and batch) grows."""
    cfg = _dwdp_cfg(isl=8192, num_requests=1536)
    cost = build_cost(cfg)
    return [(mnt, *_ratio(cfg, cost, "dwdp4", "dep4_dedup", max_batch_tokens=mnt)) for mnt in (8192, 16384, 32768)]


def table3d() -> list[tuple[int, float, str]]:
    """DWDP over DEP (DeepEP layout) with 3 and 4 ranks, ISL 16K, MNT 32K (DWDP Table 3d)."""
    cfg = _dwdp_cfg(isl=16384, num_requests=1536)
    cost = build_cost(cfg)
    return [(dp, *_ratio(cfg, cost, "dwdp4", "dep4_dedup", dp=dp)) for dp in (3, 4)]


def table4_text() -> list[tuple[str, float, str]]:
    """DWDP4 without and with the contention fix over DEP4 (DeepEP layout) at ISL 8K, ratio 0.5, MNT 16K:
    the one case DWDP §5.2's text gives for Table 4."""
    cfg = _dwdp_cfg(isl=8192, isl_ratio=0.5, num_requests=1536)
    cost = build_cost(cfg)
    return [(n, *_ratio(cfg, cost, n, "dep4_dedup", max_batch_tokens=16384)) for n in ("dwdp4_naive", "dwdp4")]
