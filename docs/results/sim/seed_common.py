"""What every seed table's rows share (``seed_tables.py``): the results they read, the verdict
against the paper's number, and the row itself (its kind from ``sim/paper_inputs.py``)."""
from __future__ import annotations

import json

from moeflow.sim.paper_inputs import echoed

SIM = "docs/results/sim"


def _load(name: str) -> dict:
    with open(f"{SIM}/{name}.json") as f:
        return json.load(f)


def verdict(sim: float | None, lo: float, hi: float | None = None, tol: float = 0.15) -> str:
    """``sim`` against the paper's value ``lo`` (or range [lo, hi]) widened by ``tol``."""
    if sim is None:
        return "-"
    hi = lo if hi is None else hi
    return "within" if lo * (1 - tol) <= sim <= hi * (1 + tol) else "MISS"


def row(what: str, paper: str, sim: str, v: str, split: str = "") -> str:
    src = echoed(what)
    kind = "prediction" if src is None else f"echoes an input: {src.source} (`{src.field}`)"
    if src is None and sim.startswith("not "):
        kind = "not attempted"
    return f"| {what} | {paper} | {sim} | {v} | {kind} | {split} |"
