"""Pairs verify/decode_before_after.sh's runs: per system and batch, TPOT and tokens/s at each
commit (mean and 95% interval over repeats) and the paired after/before ratio with its verdict.

    python docs/results/decode_syncs/summary.py OUT_DIR [--md FILE.md] [--json FILE.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re

from moeflow.measure.provenance import write_json
from moeflow.measure.stats import VERDICT_RULE, mean_ci, paired_ratio_ci, verdict

_RUN = re.compile(r"(before|after)_b(\d+)_r(\d+)\.json$")


def load(out: str) -> tuple[dict, dict]:
    """{(side, system, batch): {repeat: result}}, {side: the provenance of its first run}."""
    runs, prov = {}, {}
    for path in sorted(glob.glob(os.path.join(out, "*_b*_r*.json"))):
        side, batch, rep = _RUN.search(path).groups()
        d = json.load(open(path))
        prov.setdefault(side, d["provenance"])
        for system, by_ctx in d["results"].items():
            for r in by_ctx.values():
                runs.setdefault((side, system, int(batch)), {})[int(rep)] = r
    return runs, prov


def summarise(out: str) -> dict:
    runs, prov = load(out)
    rows = []
    for system, batch in sorted({(s, b) for _, s, b in runs}, key=lambda k: (k[0], k[1])):
        a, b = runs.get(("after", system, batch), {}), runs.get(("before", system, batch), {})
        reps = sorted(set(a) & set(b))
        tp_a = [a[r]["tpot_s"]["mean"] for r in reps]
        tp_b = [b[r]["tpot_s"]["mean"] for r in reps]
        ia, ib, ratio = mean_ci(tp_a), mean_ci(tp_b), paired_ratio_ci(tp_a, tp_b)
        rows.append({"system": system, "batch": batch, "repeats": len(reps),
                     "tpot_before_s": ib.to_dict(), "tpot_after_s": ia.to_dict(),
                     "tok_s_before": mean_ci([b[r]["tok_s_per_process"]["mean"] for r in reps]).to_dict(),
                     "tok_s_after": mean_ci([a[r]["tok_s_per_process"]["mean"] for r in reps]).to_dict(),
                     "tpot_ratio_after_over_before": ratio.to_dict(), "verdict": verdict(ia, ib, ratio)})
    commits = {s: open(os.path.join(out, f"{s}.commit")).read().strip() for s in ("before", "after")}
    return {"commits": commits, "runs": prov, "rows": rows}


def markdown(s: dict) -> str:
    p = s["runs"]["after"]
    lines = [f"Before {s['commits']['before'][:7]}, after {s['commits']['after'][:7]}; {p['cpu_model']} ({p['isa']}), "
             f"{p['cores']} cores, torch {p['torch']}, dtype auto ({p['auto_dtype']}). {VERDICT_RULE}.", "",
             "| system | batch | TPOT before ms | TPOT after ms | after/before | tok/s per process before | after | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        f = lambda d, k=1e3: f"{d['mean'] * k:.1f} [{d['ci95'][0] * k:.1f}, {d['ci95'][1] * k:.1f}]"
        ratio = r["tpot_ratio_after_over_before"]
        lines.append(f"| {r['system']} | {r['batch']} | {f(r['tpot_before_s'])} | {f(r['tpot_after_s'])} | "
                     f"{ratio['mean']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] | "
                     f"{r['tok_s_before']['mean']:.0f} | {r['tok_s_after']['mean']:.0f} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    s = summarise(a.out)
    if a.json:
        write_json(a.json, s)
    text = markdown(s)
    if a.md:
        open(a.md, "w").write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
