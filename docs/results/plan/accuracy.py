"""The simulator's measured accuracy, per kind of case, as ``moeflow plan`` prints it beside its
pick: read from the committed results (the seed tables, the production anchor, this machine's plan
validation) and written to ``moeflow/plan/accuracy.json`` (a test regenerates it and compares).

    python docs/results/plan/accuracy.py    # after make seed-tables or a new validation
"""
from __future__ import annotations

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
OUT = os.path.join(ROOT, "moeflow", "plan", "accuracy.json")
SEEDS = {"ASAP on CloudMatrix384": "asap", "DWDP on GB200": "dwdp", "FastAFD on GB200": "afd"}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def seed_cases(text: str) -> dict:
    """Per seed table: its predictions within tolerance, of those compared, and the file."""
    out, table = {}, None
    for line in text.splitlines():
        m = re.match(r"## (.+?) \(configs/", line)
        if m:
            table = SEEDS.get(m.group(1))
            if table:
                out[table] = {"source": f"{m.group(1)}, docs/results/sim/seed_tables.md", "within": 0, "compared": 0}
            continue
        cells = _cells(line) if line.startswith("|") else []
        if table and len(cells) > 4 and cells[4] == "prediction":  # the verdict, then what the row is
            v = cells[3]
            if v in ("within", "MISS"):
                out[table]["compared"] += 1
                out[table]["within"] += v == "within"
    return out


def anchor_case(text: str) -> dict:
    """The production anchor's simulated / published ratios, per phase."""
    ratios: dict[str, list[float]] = {}
    for line in text.splitlines():
        c = _cells(line) if re.match(r"\| (SGLang )?(prefill|decode),", line) else None
        if c:
            ratios.setdefault(c[0].split(",")[0].replace("SGLang ", "SGLang's "), []).append(float(c[3].rstrip("x")))
    return {"source": "DeepSeek-V3/R1's H800 service and SGLang's 96 x H100 (dep), docs/results/sim/anchors.md",
            "ratio": {k: [min(v), max(v)] for k, v in ratios.items()}}


def validation_case(text: str) -> dict:
    """The validation that decides (decide/README.md): Kendall's tau with its interval, whether the
    top pick measured best, and the measured / predicted SLO rates."""
    m = re.search(r"Kendall's tau-b, predicted against measured medians: ([-+.\d]+), 95% bootstrap interval "
                  r"\[([-+.\d]+), ([-+.\d]+)\]", text)
    rows = [_cells(line) for line in text.splitlines() if re.match(r"\| (pd_|dep\d|afd_|asap_|dwdp\d)", line)]
    ratios = [float(r[4]) for r in rows if len(r) == 5]
    return {"source": "this machine's plan validation, docs/results/plan/decide/README.md",
            "tau": float(m.group(1)), "tau_interval": [float(m.group(2)), float(m.group(3))],
            "deployments": len(ratios), "top_pick_best": "is the measured best" in text,
            "measured_over_predicted": [min(ratios), max(ratios)]}


def build() -> dict:
    def read(*p: str) -> str:
        with open(os.path.join(ROOT, *p)) as f:
            return f.read()
    return {"seeds": seed_cases(read("docs", "results", "sim", "seed_tables.md")),
            "anchor": anchor_case(read("docs", "results", "sim", "anchors.md")),
            "here": validation_case(read("docs", "results", "plan", "decide", "README.md"))}


def text(d: dict) -> str:
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else OUT, "w") as f:
        f.write(text(build()))
