"""The plan's answers as AIConfigurator shows them: each ranked deployment's output tokens/s per
user against output tokens/s per device (and per USD an hour), the deployments no other beats on
both, and what each costs (sim/prices.py)."""
from __future__ import annotations

from moeflow.layout import layout_from_dict


def price(ranked: list[dict], choice, osl: int) -> None:
    """Adds to each feasible answer with a rate: TPS/user (1 / its TPOT at the SLO), TPS/device, and
    where its presets have prices, USD/h, requests per USD and TPS per USD/h."""
    for r in ranked:
        if not r.get("feasible") or not r.get("slo_rps"):
            continue
        at = r.get("at_slo") or {}
        tpot = at.get("tpot_mean_s") or at.get("tpot_p90_s")
        r["tps_per_user"] = 1 / tpot if tpot else None
        r["tps_per_device"] = r["slo_rps"] * osl / r["devices"]
        if choice is None:
            continue
        system = r["layout"]
        layout = layout_from_dict({k: v for k, v in system.items() if k not in ("engine", "hardware")}, r["name"])
        usd = choice.usd_per_hour(layout, system.get("hardware") or {})
        if usd:
            r.update(usd_per_hour=usd, requests_per_usd=r["slo_rps"] * 3600 / usd, tps_per_usd_hour=r["slo_rps"] * osl / usd)


RANK_KEY = {"device": "goodput_per_device", "cost": "requests_per_usd"}  # --rank-by -> an answer's field


def rank(ranked: list[dict], by: str) -> list[dict]:
    """Feasible answers first, best goodput per device (``by="device"``) or per USD (``"cost"``) first."""
    key = RANK_KEY[by]
    return sorted(ranked, key=lambda r: (not r["feasible"], -(r.get(key) or 0.0), r["name"]))


def front(ranked: list[dict], y: str) -> list[dict]:
    """The answers no other has both more TPS/user and more ``y``, by TPS/user descending."""
    pts = [r for r in ranked if r.get("tps_per_user") and r.get(y)]
    keep = [r for r in pts if not any(o is not r and o["tps_per_user"] >= r["tps_per_user"] and o[y] >= r[y]
                                      and (o["tps_per_user"], o[y]) != (r["tps_per_user"], r[y]) for o in pts)]
    return sorted(keep, key=lambda r: -r["tps_per_user"])


def show(ranked: list[dict], name) -> list[str]:
    """The two fronts as lines (``name(r)``: how an answer is named)."""
    lines = []
    for y, label in (("tps_per_device", "output tok/s per device"), ("tps_per_usd_hour", "output tok/s per USD/h")):
        pts = front(ranked, y)
        if pts:
            lines.append(f"Pareto front, TPS/user against {label}:")
            lines += [f"  {r['tps_per_user']:8.3g} tok/s/user  {r[y]:10.4g}  {name(r)}" for r in pts]
    return lines
