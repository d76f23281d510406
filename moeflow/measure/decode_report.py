"""``bench decode``'s aggregation and Markdown: per system and context the mean and 95% interval of
TPOT and decode tokens/s per process over repeats, the mean step split per worker, and paired
ratios between systems with a verdict. Pure Python (no torch)."""
from __future__ import annotations

import statistics

from moeflow.measure.stats import VERDICT_RULE, mean_ci, paired_ratio_ci, verdict

KINDS = ("attention", "ffn", "transport", "wait", "bubble")


def _split_mean(runs: list[dict]) -> dict | None:
    splits = [r["split"] for r in runs if r.get("split")]
    if not splits:
        return None
    procs = sorted({p for s in splits for p in s})
    return {p: {k: statistics.fmean(s[p].get(k, 0.0) for s in splits if p in s) for k in KINDS} for p in procs}


def summarize(exp, runs: dict[str, dict[int, list[dict]]], systems: dict) -> dict:
    out = {"title": exp.title, "model": exp.model, "dtype": exp.dtype, "steps": exp.steps,
           "warmup_steps": exp.warmup_steps, "repeats": exp.repeats, "systems": {n: {**d, "env": exp.env.get(n, {})} for n, d in systems.items()},
           "results": {}, "comparisons": []}
    for name, by_ctx in runs.items():
        out["results"][name] = {}
        for c, rs in by_ctx.items():
            tpot, tok = mean_ci([r["tpot_s"] for r in rs]), mean_ci([r["tok_s_per_process"] for r in rs])
            out["results"][name][str(c)] = {
                "batch": rs[0]["batch"], "resident_per_group": rs[0]["resident_per_group"],
                "num_kv_blocks": rs[0]["num_kv_blocks"], "tpot_s": tpot.to_dict(),
                "tok_s_per_process": tok.to_dict(), "split": _split_mean(rs), "runs": rs}
    for a, b in exp.compare:
        for c in exp.contexts:
            ra, rb = runs[a][c], runs[b][c]
            ia = mean_ci([r["tok_s_per_process"] for r in ra])
            ib = mean_ci([r["tok_s_per_process"] for r in rb])
            ratio = paired_ratio_ci([r["tok_s_per_process"] for r in ra], [r["tok_s_per_process"] for r in rb])
            out["comparisons"].append({"a": a, "b": b, "context": c, "ratio_tok_s_per_process": ratio.to_dict(),
                                       "verdict": verdict(ia, ib, ratio)})
    return out


def markdown(result: dict) -> str:
    lines = [f"## {result['title'] or 'Steady-state decode'}", "",
             f"model {result['model']}, dtype {result['dtype']}, {result['steps']} timed tokens per request, "
             f"{result['repeats']} repeats (mean ± 95% CI)", "",
             "| system | context | resident (per group) | TPOT ms | decode tok/s per process |", "|---|---|---|---|---|"]
    for name, by_ctx in result["results"].items():
        for c, r in by_ctx.items():
            t, k = r["tpot_s"], r["tok_s_per_process"]
            lines.append(f"| {name} | {c} | {r['batch']} ({r['resident_per_group']:g}) | "
                         f"{_fmt(t, 1e3)} | {_fmt(k, 1)} |")
    if result["comparisons"]:
        lines += ["", f"Ratios paired by repeat; {VERDICT_RULE}.", "",
                  "| a / b | context | tok/s per process ratio | verdict |", "|---|---|---|---|"]
        for cmp in result["comparisons"]:
            lines.append(f"| {cmp['a']} / {cmp['b']} | {cmp['context']} | {_fmt(cmp['ratio_tok_s_per_process'], 1)} | "
                         f"{cmp['verdict']} |")
    lines += ["", "Step split (fraction of the window, per worker's main thread):", "",
              "| system | context | worker | " + " | ".join(KINDS) + " |", "|---|---|---|" + "---|" * len(KINDS)]
    for name, by_ctx in result["results"].items():
        for c, r in by_ctx.items():
            for proc, sp in (r["split"] or {}).items():
                lines.append(f"| {name} | {c} | {proc} | " + " | ".join(f"{sp[k]:.2f}" for k in KINDS) + " |")
    return "\n".join(lines) + "\n"


def _fmt(iv: dict | None, scale: float) -> str:
    if not iv:
        return "–"
    lo, hi = iv["ci95"]
    if iv["n"] < 2:
        return f"{iv['mean'] * scale:.3g}"
    return f"{iv['mean'] * scale:.3g} ± {(hi - lo) / 2 * scale:.2g}"
