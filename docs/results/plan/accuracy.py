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
        if table and line.startswith("|") and line.rstrip().endswith("| prediction |"):
            v = _cells(line)[3]
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
    m = re.search(r"Pairs in the predicted order: (\d+) of (\d+)", text)
    return {"source": "this machine's plan validation, docs/results/plan/validate.md",
            "pairs_in_order": int(m.group(1)), "pairs": int(m.group(2))}


def build() -> dict:
    def read(*p: str) -> str:
        with open(os.path.join(ROOT, *p)) as f:
            return f.read()
    return {"seeds": seed_cases(read("docs", "results", "sim", "seed_tables.md")),
            "anchor": anchor_case(read("docs", "results", "sim", "anchors.md")),
            "here": validation_case(read("docs", "results", "plan", "validate.md"))}


def text(d: dict) -> str:
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else OUT, "w") as f:
        f.write(text(build()))
