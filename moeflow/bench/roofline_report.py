"""``bench roofline``'s result as text: the console summary and the markdown tables (the JSON is the
result itself). FLOP rates print in GFLOP/s on a CPU and TFLOP/s on a GPU; bytes in GB (1e9)."""
from __future__ import annotations


def _flops(r: dict, x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP/s" if r["device"]["kind"] == "cuda" else f"{x / 1e9:.1f} GFLOP/s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _header(r: dict) -> list[str]:
    s, d, c = r["shape"], r["device"], r["ceilings"]
    where = d["name"] + (f", driver {d.get('driver')}, CUDA {d.get('cuda')}" if d["kind"] == "cuda"
                         else f", {d.get('isa')}, {d.get('cores')} cores, {d['threads']} torch thread(s)")
    sheet = c["datasheet"]
    weights = f"random weights {r['weights']['bytes'] / 1e9:.2f} GB" if r["weights"] else "no model (ceilings only)"
    lines = [f"shape {s['name']} ({s['architecture']}): {s['layers']} of {s['layers_total']} layers "
             f"({s['dense_layers']} dense, {s['moe_layers']} MoE), {weights}, {r['dtype']}",
             f"device {where}; torch {d['torch']}",
             f"ceilings measured here: GEMM {_flops(r, c['gemm']['flop_per_s'])} {c['gemm']['shape']}, "
             f"copy {c['copy']['bytes_per_s'] / 1e9:.1f} GB/s"
             + (f"; datasheet ({sheet['name']}): {_flops(r, sheet['flop_per_s'].get(r['dtype'], 0))}, "
                f"{sheet['bytes_per_s'] / 1e9:.0f} GB/s" if sheet else "; no datasheet peak for this device")]
    if s.get("note"):
        lines.append(f"note: {s['note']}")
    return lines


def _prefill_rows(r: dict) -> list[list[str]]:
    p = r["prefill"]
    if p is None:
        return []
    return [[f"{len(p['seq_lens'])} x {p['seq_lens'][0]}", f"{p['seconds'] * 1e3:.1f}", f"{p['tokens_per_s']:.0f}",
             f"{p['flops'] / 1e9:.1f}", _flops(r, p["flop_per_s"]), _pct(p["share_of_gemm"]),
             _pct(p["share_of_datasheet"])]]


def _decode_rows(r: dict) -> list[list[str]]:
    rows = []
    for d in r["decode"]:
        b = d["bytes"]
        weights = b["total"] - b["kv_cache"]
        touched = d["experts_touched"]
        rows.append([str(d["batch"]), str(d["context"]), f"{d['seconds'] * 1e3:.2f}", f"{d['tokens_per_s']:.1f}",
                     f"{weights / 1e9:.3f}", f"{b['kv_cache'] / 1e9:.3f}",
                     f"{sum(touched) / len(touched):.1f}" if touched else "-",
                     f"{d['bytes_per_s'] / 1e9:.1f}", f"{d['copy_bound_s'] * 1e3:.2f}", _pct(d["share_of_copy"]),
                     _pct(d["share_of_datasheet"])])
    return rows


PREFILL_COLS = ["prompts", "time ms", "tokens/s", "GFLOP", "achieved", "of GEMM", "of datasheet"]
DECODE_COLS = ["batch", "context", "TPOT ms", "tokens/s", "weights GB", "KV GB", "experts/layer", "GB/s",
               "copy-bound ms", "of copy", "of datasheet"]


def _profile_lines(r: dict) -> list[str]:
    p = r["profile"]
    if p is None:
        return []
    lines = [f"profiled decode step (batch {p['batch']}, context {p['context']}): {p['ops']} {p['ops_what']}"
             + (f" (+{p['copies']} copies/memsets)" if p.get("copies") else "")
             + f", busy {_pct(p['busy_share'])} of its {p['span_s'] * 1e3:.1f} ms span"]
    for t in p["top"][:5]:
        lines.append(f"  {t['seconds'] * 1e3:8.2f} ms  {_pct(t['share_of_span']):>6}  x{t['count']:<5} {t['name']}")
    return lines


def print_result(r: dict) -> None:
    for line in _header(r):
        print(line)
    for cols, rows in ((PREFILL_COLS, _prefill_rows(r)), (DECODE_COLS, _decode_rows(r))):
        if rows:
            widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
            print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
            for row in rows:
                print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for line in _profile_lines(r):
        print(line)
    for name, err in r["errors"].items():
        print(f"FAILED {name}: {err}")


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(r: dict) -> str:
    prov = r.get("provenance") or {}
    out = [f"# bench roofline: {r['shape']['name']} on {r['device']['name']}", ""]
    out += [f"- {line}" for line in _header(r)]
    out += [f"- commit {prov.get('commit')}{' (dirty)' if prov.get('dirty') else ''}: `{prov.get('command')}`", ""]
    if r["prefill"]:
        out += ["## Prefill", ""] + _table(PREFILL_COLS, _prefill_rows(r)) + [""]
    if r["decode"]:
        out += ["## Decode", ""] + _table(DECODE_COLS, _decode_rows(r)) + [""]
    if r["profile"]:
        out += ["## One decode step, profiled", "", "```"] + _profile_lines(r) + ["```", ""]
    if r["errors"]:
        out += ["## Failed", ""] + [f"- {k}: {v}" for k, v in r["errors"].items()] + [""]
    return "\n".join(out)
