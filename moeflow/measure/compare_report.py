"""``bench compare``'s aggregation and its Markdown: per point the mean and 95% interval over
repeats, SLO throughput per repeat under every metric (median and range), paired ratios between
systems with a verdict, and each system's saturation throughput as a fraction of the machine's
capacity with the measured time split. Pure Python (no torch).
"""
from __future__ import annotations

import statistics

from moeflow.measure.slo import ALL_METRICS, format_slo, slo_over_repeats
from moeflow.measure.stats import VERDICT_RULE, mean_ci, paired_ratio_ci, verdict

POINT_FIELDS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefill_tok_s",
                "output_tok_s", "resident_mean", "preemptions",  # the last three: not in results before issue 29
                # decode and the whole system (issue 30): TPOT, TPS/user, output tok/s per process, goodput
                "tpot_mean_s", "tpot_p90_s", "tps_user_mean", "output_tok_s_per_process", "goodput_rps",
                "slo_attainment", "handoff_mean_s")


def aggregate_points(repeats: list[dict]) -> list[dict]:
    """One point per rate of the sweep: the mean over repeats of each field, with ``<field>_ci``."""
    rates = sorted({p["rps"] for r in repeats for p in r["sweep"]})
    out = []
    for rate in rates:
        per = [next((p for p in r["sweep"] if p["rps"] == rate), None) for r in repeats]
        per = [p for p in per if p is not None]
        point = {"rps": rate, "repeats": len(per), "completed": sum(p["completed"] for p in per),
                 "completed_per_repeat": [p["completed"] for p in per],
                 "failed": sum(p["failed"] for p in per), "rejected": sum(p["rejected"] for p in per)}
        for f in POINT_FIELDS:
            ci = mean_ci([p.get(f) for p in per])
            point[f] = ci.mean if ci else None
            point[f + "_ci"] = [ci.lo, ci.hi] if ci else None
        out.append(point)
    return out


def slo_by_metric(repeats: list[dict]) -> dict[str, dict]:
    """Per metric: the per-repeat SLO throughputs, their median and range (``slo_over_repeats``:
    an unbracketed repeat counts as the bound it is)."""
    return {m.name: slo_over_repeats([r.get("slo", {}).get(m.name) for r in repeats]) for m in ALL_METRICS}


def saturation_summary(repeats: list[dict], capacity_tok_s: float | None) -> dict | None:
    sat = [r.get("saturation") for r in repeats if r.get("saturation")]
    if not sat:
        return None
    tok = mean_ci([s["prefill_tok_s"] for s in sat])
    flags = [s.get("saturated") for s in sat]  # None: measured before the probe checked (one fixed rate)
    out = {"rps": max(s["rps"] for s in sat), "offered_rps": [s["rps"] for s in sat],
           "saturated": False if False in flags else None if None in flags else True,
           "tok_s": tok.to_dict() if tok else None}
    if capacity_tok_s and tok and out["saturated"] is not False:  # the offered load is no share of capacity
        frac = mean_ci([s["prefill_tok_s"] / capacity_tok_s for s in sat if s["prefill_tok_s"]])
        out["capacity_fraction"] = frac.to_dict() if frac else None
    splits = [s["time_split"] for s in sat if s.get("time_split")]
    if splits:  # mean over repeats, per process and kind
        procs = sorted({p for sp in splits for p in sp})
        out["time_split"] = {p: {k: statistics.fmean(sp[p][k] for sp in splits if p in sp)
                                 for k in ("compute", "transport", "wait", "idle")} for p in procs}
    copies = [s["copy_busy"] for s in sat if s.get("copy_busy")]
    if copies:  # dwdp: the copy thread's busy fraction per rank
        out["copy_busy"] = {p: statistics.fmean(c.get(p, 0.0) for c in copies) for p in sorted({p for c in copies for p in c})}
    return out


def comparison(name_a: str, a: dict, name_b: str, b: dict, metric: str) -> dict:
    """a vs b: per rate the paired ratio of mean TTFT (b / a: > 1 means a is faster) and the
    verdict; SLO throughput ratio a / b per repeat."""
    rows = []
    for pa in a["points"]:
        pb = next((p for p in b["points"] if p["rps"] == pa["rps"]), None)
        if pb is None:
            continue
        va = [_field(r, pa["rps"]) for r in a["repeats"]]
        vb = [_field(r, pa["rps"]) for r in b["repeats"]]
        ia, ib = mean_ci(va), mean_ci(vb)
        ratio = paired_ratio_ci(vb, va)
        row = {"rps": pa["rps"], "ttft_ratio_b_over_a": ratio.to_dict() if ratio else None,
               "verdict": verdict(ia, ib, ratio)}
        # a / b, paired per repeat: output tokens/s (> 1: a generates faster), TPS/user (> 1: a's users
        # get their tokens faster)
        for field, key in (("output_tok_s", "output"), ("tps_user_mean", "tps_user")):
            xa = [_field(r, pa["rps"], field) for r in a["repeats"]]
            xb = [_field(r, pa["rps"], field) for r in b["repeats"]]
            if all(xa) and all(xb):
                ratio_ab = paired_ratio_ci(xa, xb)
                row[f"{key}_ratio_a_over_b"] = ratio_ab.to_dict() if ratio_ab else None
                row[f"{key}_verdict"] = verdict(mean_ci(xa), mean_ci(xb), ratio_ab)
        rows.append(row)
    slo_ratio = slo_over_repeats([_slo_ratio(r.get("slo", {}).get(metric), q.get("slo", {}).get(metric))
                                  for r, q in zip(a["repeats"], b["repeats"])])
    out = {"a": name_a, "b": name_b, "metric": metric, "per_rate": rows, "slo_ratio_a_over_b": slo_ratio}
    unsaturated = {n: max(r["saturation"]["rps"] for r in x["repeats"] if r.get("saturation"))
                   for n, x in ((name_a, a), (name_b, b))
                   if any((r.get("saturation") or {}).get("saturated") is False for r in x["repeats"])}
    ta, tb = ([(r.get("saturation") or {}).get("prefill_tok_s") for r in x["repeats"]] for x in (a, b))
    if unsaturated:  # a served offered load is not a saturation throughput: no ratio of it
        out["not_saturated_at_rps"] = unsaturated
    elif any(ta) and any(tb):  # saturation throughput a / b, paired per repeat
        ratio = paired_ratio_ci(ta, tb)
        out["saturation_ratio_a_over_b"] = {"ratio": ratio.to_dict() if ratio else None,
                                            "verdict": verdict(mean_ci(ta), mean_ci(tb), ratio)}
    return out


def _slo_ratio(a: dict | None, b: dict | None) -> dict | None:
    """One repeat's SLO throughput a / b: known when both are; a bound when only a's is a bound."""
    x, y, x_min = (a or {}).get("rps"), (b or {}).get("rps"), (a or {}).get("at_least_rps")
    if not y:
        return None
    return {"rps": x / y} if x else {"at_least_rps": x_min / y} if x_min else None


def _field(repeat: dict, rate: float, field: str = "ttft_mean_s"):
    p = next((p for p in repeat["sweep"] if p["rps"] == rate), None)
    return None if p is None else p.get(field)


def _ci(point: dict, field: str, scale: float = 1.0) -> str:
    v, ci = point.get(field), point.get(field + "_ci")
    if v is None:
        return "-"
    if not ci or ci[0] == ci[1]:
        return f"{v * scale:.3g}"
    return f"{v * scale:.3g} ± {(ci[1] - ci[0]) / 2 * scale:.2g}"


def _ratio(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['mean']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["n"] > 1 else f"{r['mean']:.3f}"


def format_over_repeats(d: dict, fmt: str = ".3g") -> str:
    """``slo_over_repeats``'s median [min, max], each ``>= X`` where only a bound is known."""
    def stat(name: str) -> str:
        return format_slo(d.get(name), d.get(name + "_at_least"), fmt)

    vals = d.get("values", [])
    bounds = d.get("at_least_values") or [None] * len(vals)
    if d.get("median") is None and d.get("median_at_least") is None:
        return "none meets it" if vals else "-"
    met = sum(v is not None or b is not None for v, b in zip(vals, bounds))
    # the median is over the repeats that met the SLO at some probed rate: say how many did
    return f"{stat('median')} [{stat('min')}, {stat('max')}]" + (f" ({met} of {len(vals)} repeats)"
                                                                if met < len(vals) else "")


def markdown(result: dict) -> str:
    """The report: provenance, TTFT tables, SLO throughput per metric, ratios, capacity."""
    prov, systems = result["provenance"], result["systems"]
    lines = [f"# {result.get('title') or 'bench compare'}", "",
             f"Command: `{prov['command']}`  ", f"Commit {prov['commit']}{' (dirty)' if prov.get('dirty') else ''}, "
             f"{prov['date']}, {prov['cpu_model']} ({prov.get('isa', '?')}), {prov['cores']} cores, "
             f"torch {prov['torch']}; dtype {result.get('dtype')}; {result['repeats']} repeats (seeds "
             f"{result['seeds']}), systems in rotated order at every rate; 95% t-intervals over repeats; "
             f"{VERDICT_RULE}.", ""]
    rates = sorted({p["rps"] for s in systems.values() for p in s["points"]})
    # a saturation-only experiment (no rates) has no TTFT tables and no SLO throughput
    tables = [("ttft_mean_s", "Mean TTFT (s)"), ("ttft_p90_s", "p90 TTFT (s)"),
              ("prefill_tok_s", "Prefill throughput (tok/s)"), ("output_tok_s", "Output throughput (tok/s)"),
              ("resident_mean", "Requests admitted at once (time-weighted)"), ("preemptions", "Preemptions per point"),
              ("tpot_mean_s", "Mean TPOT (s)"), ("tpot_p90_s", "p90 TPOT (s)"),
              ("tps_user_mean", "TPS/user (mean of 1/TPOT over requests)"),
              ("output_tok_s_per_process", "Output tok/s per process"),
              ("goodput_rps", f"Goodput (rps within TTFT {result.get('slo_ttft_s')} s and TPOT "
                              f"{result.get('slo_tpot_s')} s)"),
              ("slo_attainment", "Share of requests within both SLOs"), ("handoff_mean_s", "Mean KV handoff (s)")]
    present = {f for s in systems.values() for p in s["points"] for f in POINT_FIELDS if p.get(f) is not None}
    for field, title in [(f, t) for f, t in tables if f in present] if rates else ():
        lines += [f"## {title}, mean ± half-width of the 95% interval", "",
                  "| system | " + " | ".join(f"{r:g} rps" for r in rates) + " |", "|---|" + "---|" * len(rates)]
        for name, s in systems.items():
            by_rate = {p["rps"]: p for p in s["points"]}
            lines.append(f"| {name} | " + " | ".join(_ci(by_rate[r], field) if r in by_rate else "-" for r in rates)
                         + " |")
        lines.append("")
    slo = result.get("slo_ttft_s")
    if slo is not None and rates:
        lines += [f"## SLO throughput (rps) at TTFT SLO {slo:g} s, median [range] over repeats", "",
                  "Each metric decided on the same measured points (sweep + search probes); the search "
                  f"itself bisected on `{result.get('slo_metric')}`. `>= X`: no rate above X was measured to miss "
                  "the SLO (X is the sweep's highest rate or the search's cap), so X is a lower bound only.", "",
                  "| system | " + " | ".join(m.name for m in ALL_METRICS) + " |", "|---|" + "---|" * len(ALL_METRICS)]
        for name, s in systems.items():
            by = s["slo_rps_by_metric"]
            lines.append(f"| {name} | " + " | ".join(format_over_repeats(by[m.name]) for m in ALL_METRICS) + " |")
        lines.append("")
    for c in result.get("comparisons", []):
        lines += [f"## {c['a']} vs {c['b']}", ""]
        if rates:
            if slo is not None:
                lines += [f"SLO throughput ratio {c['a']}/{c['b']} ({c['metric']}): "
                          f"{format_over_repeats(c['slo_ratio_a_over_b'])}", ""]
            extra = [(k, t) for k, t in (("output", "output tok/s"), ("tps_user", "TPS/user"))
                     if any(f"{k}_ratio_a_over_b" in row for row in c["per_rate"])]
            lines += [f"| rate | mean TTFT {c['b']} / {c['a']} (paired, 95% CI) | verdict |"
                      + "".join(f" {t} {c['a']} / {c['b']} (paired, 95% CI) | verdict |" for _, t in extra),
                      "|---|---|---|" + "---|---|" * len(extra)]
            for row in c["per_rate"]:
                lines.append(f"| {row['rps']:g} | {_ratio(row['ttft_ratio_b_over_a'])} | {row['verdict']} |"
                             + "".join(f" {_ratio(row.get(f'{k}_ratio_a_over_b'))} | {row.get(f'{k}_verdict', '-')} |"
                                       for k, _ in extra))
            lines.append("")
        sat = c.get("saturation_ratio_a_over_b")
        if sat:
            lines += [f"Saturation prefill tokens/s {c['a']}/{c['b']} (paired, 95% CI): {_ratio(sat['ratio'])}, "
                          f"{sat['verdict']}"]
        for name, rps in (c.get("not_saturated_at_rps") or {}).items():
            lines += [f"No saturation ratio: {name} not saturated at {rps:g} rps."]
        lines.append("")
    cap = result.get("capacity")
    if cap:
        lines += ["## The machine's capacity and each system's share of it", "",
                  f"Capacity: {cap['tok_s']:.0f} prompt tok/s = {cap['cores']} cores x mean "
                  f"{cap['mean_prompt_tokens']:.0f} tokens / {cap['mean_request_compute_s']:.3f} s colocated "
                  f"compute per request (profile: `{cap.get('profile')}`, {cap.get('profile_dtype')}). Each "
                  "saturation probe doubles its offered rate until a doubling raises prefill tok/s by less than "
                  "10% (`measure/saturation.py`); one that never does is not saturated and has no share.", "",
                  "| system | offered rps | prefill tok/s | fraction of capacity | time split per process "
                  "(compute / transport / wait / idle) |", "|---|---|---|---|---|"]
        for name, s in systems.items():
            sat = s.get("saturation")
            if not sat:
                continue
            tok, frac = sat.get("tok_s"), sat.get("capacity_fraction")
            tok_txt = "-" if not tok else f"{tok['mean']:.0f} [{tok['ci95'][0]:.0f}, {tok['ci95'][1]:.0f}]"
            if sat.get("saturated") is False:
                tok_txt = f"not saturated at {sat['rps']:g} rps (served {tok_txt})"
            elif sat.get("saturated") is None:  # a result from before the probe checked
                tok_txt += " (saturation not checked)"
            frac_txt = "-" if not frac else f"{frac['mean']:.1%} [{frac['ci95'][0]:.1%}, {frac['ci95'][1]:.1%}]"
            copy = sat.get("copy_busy") or {}
            split = "; ".join(f"{p}: {v['compute']:.0%}/{v['transport']:.0%}/{v['wait']:.0%}/{v['idle']:.0%}"
                              + (f" (copy thread {copy[p]:.0%})" if p in copy else "")
                              for p, v in (sat.get("time_split") or {}).items())
            offered = ", ".join(f"{r:g}" for r in sorted(set(sat.get("offered_rps") or [sat["rps"]])))
            lines.append(f"| {name} | {offered} | {tok_txt} | {frac_txt} | {split or '-'} |")
        lines.append("")
    return "\n".join(lines)
