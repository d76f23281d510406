"""An end-to-end disaggregated Pareto (``experiment/e2e.py``): each context system against the same
generation sweep, the split of each point chosen by rate matching.

1. Context side, prefill only: one instance at saturation (every request at once) gives the
   requests per second it sustains, C.
2. Generation side: each generation system at each batch decodes in steady state at the decode
   context (``decode.py``): TPOT, so TPS/user = 1 / TPOT, and the requests per second it completes,
   R = batch / (output_len · TPOT).
3. Each (context, generation point) pair: X context and Y generation instances by rate matching in
   the domain's devices; output TPS/device = Y·R · output_len / devices. Each context system's
   front is the Pareto of (TPS/user, output TPS/device) over the sweep.
4. TTFT: each front point's context pool at the rate it is matched to (Poisson arrivals at Y·R / X
   per instance), its median TTFT simulated.
5. The ratios of each front to the baseline's: output TPS/device at equal TPS/user (over the band
   and over the range) and TPS/user at equal output TPS/device (over the band's TPS/device).
"""
from __future__ import annotations

import dataclasses
import math

from moeflow.experiment.e2e import E2eExperiment
from moeflow.sim.decode import simulate_decode
from moeflow.sim.rate_match import Side, front_at, front_ratio, pareto_front, rate_match
from moeflow.sim.run import run_point

_SATURATION_RPS = 1e4  # every request at once: the context instance's own throughput


def context_capacity(spec, cost, cfg, num_requests: int) -> dict:
    """One context instance, prefill only, at saturation: requests/s and prompt tokens/s."""
    p, _ = run_point(spec, cost, cfg, _SATURATION_RPS, num_requests=num_requests)
    return {"rps": p["completed"] / p["duration_s"], "prefill_tok_s": p["prefill_tok_s"],
            "devices": spec.layout.num_processes, "busy": p["sim_busy"]}


def generation_points(x: E2eExperiment, cost, context: int) -> list[dict]:
    """Every generation system at every batch that fits its KV (the others are skipped, with why)."""
    e, osl = x.e2e, x.experiment.workload.output_len
    out = []
    for name, spec in e.decode.items():
        for b in e.decode_batches:
            try:
                d = simulate_decode(spec, cost, context, e.decode_steps, e.decode_warmup_steps,
                                    getattr(getattr(cost, "hw", None), "hbm_bytes", 0.0), batch=b * spec.layout.num_groups)
            except ValueError as err:
                out.append({"system": name, "batch_per_group": b, "skipped": str(err)})
                continue
            total = b * spec.layout.num_groups
            out.append({"system": name, "batch_per_group": b, "devices": d["devices"], "tpot_s": d["tpot_s"],
                        "tps_user": 1 / d["tpot_s"], "rps": total / (osl * d["tpot_s"]),
                        "tok_s_per_device": d["tok_s_per_device"], "split": d["split"]})
    return out


def compose(ctx_name: str, ctx: dict, gens: list[dict], devices: int, osl: int, max_util: float) -> list[dict]:
    """Each generation point with this context system, rate-matched in ``devices``."""
    out = []
    for g in gens:
        if "skipped" in g:
            continue
        s = rate_match(Side(ctx_name, ctx["devices"], ctx["rps"]), Side(g["system"], g["devices"], g["rps"]),
                       devices, max_util, decode_bound=True)
        if s is None:
            continue
        out.append({"context": ctx_name, "generation": g["system"], "batch_per_group": g["batch_per_group"],
                    "tps_user": g["tps_user"], "tps_per_device": s.rps * osl / s.devices,
                    "context_instances": s.prefill_instances, "generation_instances": s.decode_instances,
                    "devices": s.devices, "context_devices": s.prefill_instances * ctx["devices"],
                    "rps": s.rps, "prefill_utilization": s.prefill_utilization})
    return out


def run_e2e(x: E2eExperiment, cost) -> dict:
    cfg, e = x.experiment, x.e2e
    w = cfg.workload
    osl = w.output_len
    prefill_only = dataclasses.replace(cfg, workload=dataclasses.replace(w, output_len=1))
    mean_isl = mean_prompt(w)
    context = e.decode_context or int(mean_isl + osl / 2)
    ctx = {n: context_capacity(s, cost, prefill_only, w.num_requests or 512) for n, s in cfg.systems.items()}
    gens = generation_points(x, cost, context)
    points = {n: compose(n, c, gens, e.devices, osl, e.max_prefill_utilization) for n, c in ctx.items()}
    fronts = {n: pareto_front([(p["tps_user"], p["tps_per_device"]) for p in ps]) for n, ps in points.items()}
    lo, hi = e.range_tps_user
    for n, ps in points.items():
        on = set(fronts[n])
        for p in ps:
            p["on_front"] = (p["tps_user"], p["tps_per_device"]) in on
            if p["on_front"] and lo <= p["tps_user"] <= hi:
                p["ttft_p50_s"] = _ttft(cfg.systems[n], cost, prefill_only, p, e.ttft_requests)
    base = fronts[e.baseline]
    ratios = {}
    for n in ctx:
        if n == e.baseline:
            continue
        band_tpsgpu = [y for t, y in base if e.band_tps_user[0] <= t <= e.band_tps_user[1]]
        flip = lambda f: pareto_front([(y, t) for t, y in f])  # noqa: E731  (TPS/user at equal TPS/device)
        ratios[n] = {
            "tps_per_device_band": front_ratio(fronts[n], base, *e.band_tps_user),
            "tps_per_device_range": front_ratio(fronts[n], base, *e.range_tps_user),
            "tps_user_band": front_ratio(flip(fronts[n]), flip(base), min(band_tpsgpu), max(band_tpsgpu))
            if len(band_tpsgpu) >= 2 else {"mean": _at(flip(fronts[n]), flip(base), band_tpsgpu)},
            "ttft_p50_band_s": {k: _band_ttft(points[k], *e.band_tps_user) for k in (n, e.baseline)},
            "ttft_p50_range_s": {k: _band_ttft(points[k], lo, hi) for k in (n, e.baseline)},
            "context_devices_band": {k: _band_mean(points[k], "context_devices", *e.band_tps_user)
                                     for k in (n, e.baseline)}}
    return {"context": ctx, "generation": gens, "decode_context": context, "mean_prompt": mean_isl,
            "points": points, "fronts": {n: [list(p) for p in f] for n, f in fronts.items()}, "ratios": ratios}


def _ttft(spec, cost, cfg, p: dict, n: int) -> float | None:
    rate = p["rps"] / p["context_instances"]
    q, _ = run_point(spec, cost, cfg, rate, num_requests=n)
    return q["ttft_p50_s"]


def _on_front_in(ps: list[dict], lo: float, hi: float) -> list[dict]:
    return [p for p in ps if p.get("on_front") and lo <= p["tps_user"] <= hi]


def _band_ttft(ps: list[dict], lo: float, hi: float) -> float | None:
    vals = sorted(p["ttft_p50_s"] for p in _on_front_in(ps, lo, hi) if p.get("ttft_p50_s") is not None)
    return vals[len(vals) // 2] if vals else None


def _band_mean(ps: list[dict], key: str, lo: float, hi: float) -> float | None:
    vals = [p[key] for p in _on_front_in(ps, lo, hi)]
    return sum(vals) / len(vals) if vals else None


def _at(a, b, ys: list[float]) -> float | None:
    rs = [ra / rb for y in ys if (ra := front_at(a, y)) and (rb := front_at(b, y))]
    return sum(rs) / len(rs) if rs else None


def mean_prompt(w) -> float:
    """The workload's mean prompt, from the very requests it generates."""
    from moeflow.measure.workload import generate_requests

    reqs = generate_requests(dataclasses.replace(w, rate_rps=1.0, num_requests=w.num_requests or 512))
    return sum(r.prompt_len for r in reqs) / len(reqs) if reqs else math.nan


_RATIOS = (("tps_per_device_band", "output TPS/device at equal TPS/user, band"),
           ("tps_per_device_range", "output TPS/device at equal TPS/user, range"),
           ("tps_user_band", "TPS/user at equal output TPS/device, band"))


def format_e2e(x: E2eExperiment, r: dict) -> str:
    e = x.e2e
    lines = ["context servers (one instance, prefill only, at saturation):"]
    for n, c in r["context"].items():
        lines.append(f"  {n:<12} {c['rps']:8.2f} req/s  {c['prefill_tok_s'] / c['devices']:10,.0f} prompt tok/s per device")
    lines.append(f"generation: {len(r['generation'])} points at decode context {r['decode_context']} "
                 f"({sum('skipped' in g for g in r['generation'])} do not fit their KV)")
    for n, ps in r["points"].items():
        lines.append(f"front of {n} (TPS/user, output TPS/device, context:generation instances, devices, TTFT p50):")
        for p in sorted((p for p in ps if p["on_front"]), key=lambda p: p["tps_user"]):
            ttft = f"{p['ttft_p50_s']:.2f} s" if p.get("ttft_p50_s") is not None else "-"
            lines.append(f"  {p['tps_user']:6.1f} {p['tps_per_device']:8.0f}  {p['context_instances']:2d}x{n} : "
                         f"{p['generation_instances']}x{p['generation']} b{p['batch_per_group']:<4d} "
                         f"{p['devices']:3d} devices  {ttft}")
    band, rng = e.band_tps_user, e.range_tps_user
    for n, q in r["ratios"].items():
        lines.append(f"{n} / {e.baseline} (band {band[0]:g}-{band[1]:g} TPS/user, range {rng[0]:g}-{rng[1]:g}):")
        for key, what in _RATIOS:
            v = q[key]["mean"]
            paper = f"   paper {e.paper[key]:.3g}" if key in e.paper else ""
            lines.append(f"  {what:<46} " + (f"{v:.3f}" if v is not None else "n/a") + paper)
        for key, what in (("ttft_p50_band_s", "median TTFT, band"), ("ttft_p50_range_s", "median TTFT, range"),
                          ("context_devices_band", "context devices, band (mean)")):
            a, b = q[key][n], q[key][e.baseline]
            lines.append(f"  {what:<46} " + (f"{a:.3g} vs {b:.3g}" if a is not None and b is not None else "n/a"))
    return "\n".join(lines)
