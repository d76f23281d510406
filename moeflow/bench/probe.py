"""Probes of one in-process deployment: a replay at one rate (a point of the TTFT-vs-rate curve)
and the SLO search over such replays. ``bench serve`` runs one deployment's; ``bench compare``
interleaves several deployments' probes.

Every probe starts on an idle deployment: a probe stopped early aborts what is pending and drains
what the workers still hold before it returns (``replay``).
"""
from __future__ import annotations

from collections.abc import Callable

from moeflow.bench.replay import random_prompts, replay
from moeflow.engine.eplb_report import point_report
from moeflow.measure.metrics import summarize
from moeflow.measure.slo import (ALL_METRICS, SloMetric, SloResult, SloSearch, StopRule, find_slo_rps,
                                 slo_rps_from_points)
from moeflow.measure.workload import WorkloadConfig, WorkloadRequest, generate_requests


class Prober:
    def __init__(self, llm, workload: Callable[[float | None], WorkloadConfig], seed: int, progress: bool = True,
                 slo: tuple[float, float] | None = None):
        """``workload(rate)``: the workload of a probe at ``rate`` (None: a trace as recorded); ``slo``:
        (TTFT s, TPOT s) for each point's goodput."""
        self.llm, self.workload, self.seed, self.progress, self.slo = llm, workload, seed, progress, slo
        self.vocab = llm.engine.model_config.vocab_size
        self.points: dict[float, dict] = {}

    def warm_up(self) -> None:
        """A few short prompts first: the first batches pay one-time costs (allocation, lazy init)."""
        from moeflow import SamplingParams

        reqs = [WorkloadRequest(0.0, 16, 1)] * 4
        self.llm.generate(random_prompts(reqs, self.vocab, self.seed + 1), SamplingParams(max_tokens=1, temperature=0.0))

    def measure(self, rate: float | None, stop: StopRule | None = None, label: str | None = None) -> dict:
        """One replay at ``rate``: its point (kept in ``points`` by its rate)."""
        cfg = self.workload(rate)
        reqs = generate_requests(cfg)
        prompts = random_prompts(reqs, self.vocab, cfg.seed)
        rps = rate if rate is not None else recorded_rate(reqs)
        engine = self.llm.engine
        preempted = sum(engine.load().preemptions_per_group)
        eplb = getattr(engine, "eplb", None)
        rebalances = len(eplb.history) if eplb is not None else 0
        res = replay(self.llm, reqs, prompts, label=label or f"{rps:g}rps", stop=stop, progress=self.progress)
        p = summarize(rps, res.records, res.start_s, cfg.length_scale, res.num_rejected, res.num_failed,
                      res.num_aborted, self.slo)
        p["preemptions"] = sum(engine.load().preemptions_per_group) - preempted  # KV ran out: requests recomputed
        # decode-side measures: requests admitted at once (time-weighted over the point) and output tokens/s
        p["resident_mean"] = res.resident_s / p["duration_s"] if p["duration_s"] > 0 else 0.0
        p["output_tok_s"] = res.output_tokens / p["duration_s"] if p["duration_s"] > 0 else 0.0
        p["output_tok_s_per_process"] = p["output_tok_s"] / self.llm.layout.num_processes
        if eplb is not None:  # the expert placement: its balance, and the rebalances during this point
            p.update(point_report(eplb, rebalances, res.records))
        if res.stopped_early:  # it certainly missed the SLO under stop.metric; for the mean only a bound is known
            p.update(stopped_early=True, stopped_by=stop.metric.name, ttft_mean_s=res.mean_ttft_bound_s,
                     ttft_p50_s=None, ttft_p90_s=None, ttft_p99_s=None)
        self.points[rps] = p
        return p

    def find_slo(self, search: SloSearch, early_stop: bool = True) -> SloResult:
        """Bisect for the SLO throughput under ``search.metric``, starting from the points so far."""
        stop = StopRule(search.metric, search.slo_ttft_s) if early_stop else None
        measured = {r: search.metric.score(p) for r, p in self.points.items()}
        return find_slo_rps(lambda r: search.metric.score(self.measure(r, stop)), search, measured)


def slo_table(points: list[dict], slo_s: float | None) -> dict[str, dict]:
    """SLO throughput under every metric the measured points can decide (no further probing)."""
    if slo_s is None:
        return {}
    out = {}
    for m in ALL_METRICS:
        r = slo_rps_from_points(points, m, slo_s)
        out[m.name] = {"rps": r.rps, "upper_rps": r.upper_rps, "at_least_rps": r.at_least_rps}
    return out


def recorded_rate(reqs) -> float:
    """Mean arrival rate of a trace replayed as recorded."""
    if len(reqs) < 2 or reqs[-1].arrival_s <= reqs[0].arrival_s:
        return float(len(reqs))
    return (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)


__all__ = ["Prober", "SloMetric", "slo_table", "recorded_rate"]
