"""Simulated against measured: mean TTFT error per rate and SLO-throughput error. A measured
result of ``bench compare`` carries 95% intervals: each point then says whether the simulated
mean falls inside the measured interval (an error smaller than the measurement can resolve)."""
from __future__ import annotations

import math

from moeflow.measure.slo import as_bounded, format_slo, slo_over_repeats


_DECODE_SIDE = ("tpot_mean_s", "output_tok_s", "handoff_mean_s")


def compare(simulated: dict, measured: dict) -> dict:
    """Both in ``bench serve``'s schema. Rates are matched exactly; the measured runs' rates that
    the simulation did not run are skipped (run the simulation with ``--rps`` to cover them)."""
    sim = {p["rps"]: p for p in simulated["points"]}
    rows = []
    for p in measured["points"]:
        s = sim.get(p["rps"])
        if s is None or p.get("stopped_early") or s.get("stopped_early") or p["ttft_mean_s"] is None:
            continue
        row = {"rps": p["rps"], "measured_ttft_s": p["ttft_mean_s"], "simulated_ttft_s": s["ttft_mean_s"],
               "error": s["ttft_mean_s"] / p["ttft_mean_s"] - 1}
        ci = p.get("ttft_mean_s_ci")
        if ci and ci[0] != ci[1]:
            row.update(measured_ci=ci, within_ci=bool(ci[0] <= s["ttft_mean_s"] <= ci[1]),
                       ci_half_width_rel=(ci[1] - ci[0]) / 2 / p["ttft_mean_s"])
        for key in _DECODE_SIDE:  # runs with output lengths: the decode side's means beside TTFT
            if p.get(key) and s.get(key) is not None:
                lo, hi = p.get(f"{key}_ci") or (p[key], p[key])
                row[key] = {"measured": p[key], "simulated": s[key], "error": s[key] / p[key] - 1,
                            **({"measured_ci": [lo, hi], "within_ci": bool(lo <= s[key] <= hi)} if lo != hi else {})}
        rows.append(row)
    (ms, ms_min), (ss, ss_min) = (_slo(r) for r in (measured, simulated))
    return {"points": rows, "measured_slo_rps": ms, "simulated_slo_rps": ss,
            "measured_slo_rps_at_least": ms_min, "simulated_slo_rps_at_least": ss_min,
            "slo_error": (ss / ms - 1) if ms and ss else None}


def _slo(result: dict) -> tuple[float | None, float | None]:
    """(SLO throughput, lower bound when only that is known) under the result's metric: over its
    repeats (``bench compare``, ``simulate --repeats``), else its search's, else read off its rates."""
    metric = result.get("slo_metric") or "mean"
    reps = result.get("repeats")
    if isinstance(reps, list) and reps and all("slo" in r for r in reps):
        per = [r["slo"].get(metric) for r in reps]
    elif result.get("slo_rps") is not None or result.get("slo_rps_at_least") is not None:
        per = [{"rps": result["slo_rps"], "upper_rps": result.get("slo_upper_rps"),
                "at_least_rps": result.get("slo_rps_at_least")}]
    else:
        t = (result.get("slo_rps_by_metric") or {}).get(metric) or {}
        if "median" in t:  # simulate, one seed, no search
            return t["median"], t.get("median_at_least")
        per = [t]  # bench serve's table
    s = slo_over_repeats([as_bounded(r) for r in per])
    return s["median"], s["median_at_least"]


def compare_saturation(simulated_tok_s: list[float], measured: dict) -> dict | None:
    """Prompt tokens/s at the saturation rate: the simulation once per measured seed, against the
    measured mean and its 95% interval (``bench compare``'s ``saturation`` block)."""
    sat = measured.get("saturation")
    if not sat or not simulated_tok_s:
        return None
    m = sat["tok_s"]["mean"]
    sim = sum(simulated_tok_s) / len(simulated_tok_s)
    lo, hi = sat["tok_s"].get("ci95", (m, m))
    checked = {"saturated": sat["saturated"]} if "saturated" in sat else {}  # older results did not check
    return {"rps": sat["rps"], **checked, "measured_tok_s": m, "measured_ci": [lo, hi], "simulated_tok_s": sim,
            "simulated_values": simulated_tok_s, "error": sim / m - 1, "within_ci": bool(lo <= sim <= hi)}


def format_saturation(name: str, c: dict) -> str:
    what = "not saturated (measured)" if c.get("saturated") is False else "saturation"
    return (f"{name}: {what} at {c['rps']:g} rps: measured {c['measured_tok_s']:.0f} tok/s "
            f"[{c['measured_ci'][0]:.0f}, {c['measured_ci'][1]:.0f}], simulated {c['simulated_tok_s']:.0f} tok/s "
            f"({c['error'] * 100:+.1f}%, {'inside' if c['within_ci'] else 'outside'} the measured interval)")


def format_comparison(name: str, c: dict, below_rps: float | None = None) -> str:
    lines = [f"{name}: {'rate':>7} {'measured':>9} {'simulated':>9} {'error':>7}"]
    for r in c["points"]:
        mark = "" if below_rps is None or r["rps"] < below_rps else "  (at/above saturation)"
        ci = (f"  (measured ±{r['ci_half_width_rel']:.0%}: {'inside' if r['within_ci'] else 'outside'})"
              if "within_ci" in r else "")
        lines.append(f"{'':>{len(name) + 1}} {r['rps']:>7g} {r['measured_ttft_s']:>8.2f}s {r['simulated_ttft_s']:>8.2f}s "
                     f"{r['error'] * 100:>+6.1f}%{mark}{ci}")
        for key in _DECODE_SIDE:
            if key in r:
                d = r[key]
                where = f", {'inside' if d['within_ci'] else 'outside'} its interval" if "within_ci" in d else ""
                lines.append(f"{'':>{len(name) + 9}} {key}: measured {d['measured']:.4g}, simulated "
                             f"{d['simulated']:.4g} ({d['error'] * 100:+.1f}%{where})")
    if c["slo_error"] is not None:
        lines.append(f"{'':>{len(name) + 1}} SLO throughput: measured {c['measured_slo_rps']:g} rps, simulated "
                     f"{c['simulated_slo_rps']:g} rps ({c['slo_error'] * 100:+.1f}%)")
    elif c.get("measured_slo_rps_at_least") is not None or c.get("simulated_slo_rps_at_least") is not None:
        meas, simu = (format_slo(c[f"{k}_slo_rps"], c[f"{k}_slo_rps_at_least"]) for k in ("measured", "simulated"))
        meas, simu = (f"{t} rps" if t != "-" else "no rate meeting it" for t in (meas, simu))
        lines.append(f"{'':>{len(name) + 1}} SLO throughput: measured {meas}, simulated {simu} (a bound: no error)")
    return "\n".join(lines)


def max_abs_error(c: dict, below_rps: float | None) -> float:
    errs = [abs(r["error"]) for r in c["points"] if below_rps is None or r["rps"] < below_rps]
    return max(errs) if errs else math.nan
