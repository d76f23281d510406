"""Tables for docs/results/afd.md from the results next to this file (`bench decode`, `predict afd`,
`simulate --compare-with`): `python docs/results/afd/report.py [OUT.md]` writes
docs/results/afd/tables.md (or OUT.md)."""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str) -> dict | None:
    path = os.path.join(HERE, f"{name}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def pm(d: dict, scale: float = 1.0, digits: int = 1) -> str:
    lo, hi = d["ci95"]
    return f"{d['mean'] * scale:.{digits}f} ± {(hi - lo) / 2 * scale:.{digits}f}"


def ratio(d: dict) -> str:
    lo, hi = d["ci95"]
    return f"{d['mean']:.3f} [{lo:.3f}, {hi:.3f}]"


def head_to_head(res: dict) -> list[str]:
    out = ["| system | context | resident per attention group | TPOT ms | decode tok/s per process |",
           "|---|---|---|---|---|"]
    for name, by_ctx in res["results"].items():
        for c, r in by_ctx.items():
            out.append(f"| {name} | {c} | {r['resident_per_group']:g} | {pm(r['tpot_s'], 1e3)} | "
                       f"{pm(r['tok_s_per_process'])} |")
    out += ["", "| a / b | context | tok/s per process (paired, 95% CI) | verdict |", "|---|---|---|---|"]
    for cmp in res["comparisons"]:
        out.append(f"| {cmp['a']} / {cmp['b']} | {cmp['context']} | {ratio(cmp['ratio_tok_s_per_process'])} | "
                   f"{cmp['verdict']} |")
    return out


def factors(pred: dict) -> list[str]:
    out = ["| context | m | | B_AFD / B_base | T_base / T_AFD | M/(M+N) | speed-up per process | T_AFD ms |",
           "|---|---|---|---|---|---|---|---|"]
    for row in pred["predictions"]:
        meas = row.get("measured")
        out.append(f"| {row['context']} | {row['m']} | predicted | {row['b_afd']}/{row['b_base']:g} = {row['b_ratio']:.3f} | "
                   f"{row['t_ratio']:.3f} | {row['node_factor']:.2f} | {row['speedup']:.3f} | {row['t_afd_s'] * 1e3:.1f} |")
        if meas:
            lo, hi = meas["tpot_ci95"]
            out.append(f"| | | measured ({meas['system']}) | {meas['b_afd']:g}/{row['b_base']:g} = {meas['b_ratio']:.3f} | "
                       f"{meas['t_ratio']:.3f} | {meas['node_factor']:.2f} | {meas['speedup']:.3f} | "
                       f"{meas['t_afd_s'] * 1e3:.1f} [{lo * 1e3:.1f}, {hi * 1e3:.1f}] |")
            out.append(f"| | | error | {row['b_ratio'] / meas['b_ratio'] - 1:+.1%} | {row['t_ratio'] / meas['t_ratio'] - 1:+.1%} | "
                       f"| **{row['speedup'] / meas['speedup'] - 1:+.1%}** | |")
    return out


def lm_fit(sweep: dict) -> list[str]:
    """Least squares of the measured TPOT(m) against L(m) = C/m + m*d + s (sync taken as a constant)."""
    import numpy as np

    pts = [(res["results"][f"afd_m{m}"]["2048"]["tpot_s"]["mean"], m) for m in (1, 2, 3, 4)
           for res in (sweep,) if f"afd_m{m}" in res["results"]]
    if len(pts) < 4:
        return ["(the sweep lacks a point of m = 1..4)"]
    a = np.array([[1 / m, m, 1.0] for _, m in pts])
    y = np.array([t for t, _ in pts])
    (c, d, s), *_ = np.linalg.lstsq(a, y, rcond=None)
    out = [f"L(m) = C/m + m·d + s fitted to the four measured TPOTs: C = {c * 1e3:.1f} ms, d = {d * 1e3:.1f} ms, "
           f"s = {s * 1e3:.1f} ms", "", "| m | measured TPOT ms | L(m) ms | residual |", "|---|---|---|---|"]
    for (t, m), row in zip(pts, a):
        fit = float(row @ np.array([c, d, s]))
        out.append(f"| {m} | {t * 1e3:.1f} | {fit * 1e3:.1f} | {fit / t - 1:+.1%} |")
    return out


def sim_rows(sim: dict) -> list[str]:
    out = ["| system | context | B per group measured / plan | TPOT ms measured / simulated | tok/s per process measured [95% CI] | simulated | error |",
           "|---|---|---|---|---|---|---|"]
    for r in sim.get("against_measured", []):
        lo, hi = r["tok_s_ci95"]
        out.append(f"| {r['system']} | {r['context']} | {r['b_measured']:g} / {r['b_plan']:g} | "
                   f"{r['tpot_measured_s'] * 1e3:.1f} / {r['tpot_simulated_s'] * 1e3:.1f} | "
                   f"{r['tok_s_measured']:.1f} [{lo:.1f}, {hi:.1f}] | {r['tok_s_simulated']:.1f} | "
                   f"{r['error']:+.1%}{'' if r['inside'] else ' (outside)'} |")
    return out


def stage_rows(sim: dict) -> list[str]:
    """Per step, ms in each stage: simulated (attention and daemon busy) vs the measured step split
    of the session-7 runs it was compared with (each worker's main thread; dep: rank 0)."""
    measured = load("decode_afd_session7")
    out = ["| system | context | attention side ms: measured / simulated | FFN ms: measured / simulated | "
           "measured transport + wait + bubble ms |", "|---|---|---|---|---|"]
    for name, by_ctx in sim["results"].items():
        for c, r in by_ctx.items():
            t = r["tpot_s"] * 1e3
            if r["mode"] == "dep":
                att, ffn = r["split"]["attention"] * t, r["split"]["ffn"] * t
            else:
                att, ffn = r["busy"]["attention"] * t, r["busy"]["ffn"] * t
            m = measured["results"][name][c]
            tm = m["tpot_s"]["mean"] * 1e3
            split = m["split"]
            w_att = next(w for w in split if w.startswith(("dep0", "afd_attention")))
            w_ffn = next(w for w in split if w.startswith(("dep0", "ffn")))
            rest = sum(split[w_att][k] for k in ("transport", "wait", "bubble")) * tm
            out.append(f"| {name} | {c} | {split[w_att]['attention'] * tm:.0f} / {att:.0f} | "
                       f"{split[w_ffn]['ffn'] * tm:.0f} / {ffn:.0f} | {rest:.0f} |")
    return out


def main(out: str = os.path.join(HERE, "tables.md")) -> None:
    lines = ["# Tables for afd.md (generated by report.py)", ""]
    sections = [("afd vs dep, 1.5 GiB per process (decode_afd.json)", "decode_afd", head_to_head),
                ("The three factors at m = 2, predicted from dep2's profile vs measured (predict_afd.json)",
                 "predict_afd", factors),
                ("Micro-batches and overlap scheduling at 2k, 16 resident (decode_afd_sweep.json)", "decode_afd_sweep",
                 head_to_head),
                ("predict afd per m at 2k, batch 16, vs the sweep (predict_sweep.json)", "predict_sweep", factors),
                ("predict afd without overlap scheduling vs afd_m2_noovl (predict_sweep_noovl.json)",
                 "predict_sweep_noovl", factors),
                ("L(m) against the sweep", "decode_afd_sweep", lm_fit),
                ("The simulator vs decode_afd.json (sim_decode_afd.json)", "sim_decode_afd", sim_rows),
                ("The simulator vs the sweep (sim_decode_afd_sweep.json)", "sim_decode_afd_sweep", sim_rows),
                ("afd vs dep re-measured in session 7 (decode_afd_session7.json)", "decode_afd_session7", head_to_head),
                ("The simulator after the decode fixes vs the session-7 runs (sim_decode_afd_session7.json)",
                 "sim_decode_afd_session7", sim_rows),
                ("Per step and stage: the session-7 runs vs the simulator (sim_decode_afd_session7.json)",
                 "sim_decode_afd_session7", stage_rows),
                ("The simulator after the decode fixes vs the session-6 runs (sim_decode_afd_newmodel.json)",
                 "sim_decode_afd_newmodel", sim_rows),
                ("The simulator after the decode fixes vs the session-6 sweep (sim_decode_afd_sweep_newmodel.json)",
                 "sim_decode_afd_sweep_newmodel", sim_rows)]
    for title, name, fn in sections:
        data = load(name)
        if data is None:
            continue
        lines += [f"## {title}", "", *fn(data), ""]
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:2])
