"""What a deployment's expert placement did, as results report it: a measured point's rebalances and
their latency cost, and a whole run's placement (``eplb.py`` runs them)."""
from __future__ import annotations

import dataclasses

from moeflow.engine.eplb import Eplb


def point_report(eplb: Eplb, since: int, records: list) -> dict:
    """What a measured point says of the placement: the window's balancedness at its end (mean over
    layers), the rebalances that began during it, and its requests' latency split by whether their
    life overlapped a rebalance (move to retire) or not: a rebalance's latency cost."""
    bal = eplb.window.balancedness()
    out = {"eplb_balancedness": sum(bal) / len(bal) if bal else None,
           "eplb_rebalances": [dataclasses.asdict(r) for r in eplb.history[since:]]}
    spans = [(r.started_s, r.retired_s or float("inf")) for r in eplb.history[since:]]
    if not spans:
        return out
    during = [r for r in records if any(a < r.finished_s and r.arrival_s < b for a, b in spans)]
    outside = [r for r in records if r not in during]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    out["eplb_latency"] = {"requests_during": len(during), "requests_outside": len(outside),
                           "ttft_mean_s_during": mean(r.ttft_s for r in during),
                           "ttft_mean_s_outside": mean(r.ttft_s for r in outside),
                           "tpot_mean_s_during": mean(r.tpot_s for r in during),
                           "tpot_mean_s_outside": mean(r.tpot_s for r in outside)}
    return out


def summary(eplb: Eplb | None) -> dict | None:
    """A deployment's placement over a whole run (for result files)."""
    if eplb is None:
        return None
    bal = eplb.window.balancedness()
    return {"live": eplb.live, "physical_experts": eplb.window.map.num_slots, "epoch": eplb.epoch,
            "balancedness_per_layer": bal, "rebalances": [dataclasses.asdict(r) for r in eplb.history]}


