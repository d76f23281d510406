"""No hardware constant is a seed table's paper value unless ``sim/paper_inputs.py`` lists it, and
the rows that echo a listed input are marked as echoes in the committed tables."""
from __future__ import annotations

import dataclasses
import math
import re

from moeflow.sim.hardware import PRESETS
from moeflow.sim.paper_inputs import INPUTS, echoed

TABLES = "docs/results/sim/seed_tables.md"
_UNITS = {"ms": 1e-3, "µs": 1e-6, "us": 1e-6, "s": 1.0, "%": 1e-2, "x": 1.0, "": 1.0}


def _paper_values() -> list[tuple[str, float]]:
    """(row, the paper's number in SI units) of every seed-table row with one number."""
    out = []
    for line in open(TABLES):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 5 or cells[0] in ("result", "---"):
            continue
        m = re.fullmatch(r"[+~]?([0-9.]+)\s*(ms|µs|us|s|%|x)?", cells[1])
        if m:
            out.append((cells[0], float(m.group(1)) * _UNITS[m.group(2) or ""]))
    return out


def test_every_listed_input_is_the_presets_value():
    for p in INPUTS:
        values = {getattr(hw, p.field) for hw in PRESETS.values()}
        assert any(math.isclose(v, p.value, rel_tol=1e-9) for v in values), (p.field, values)


def test_a_preset_constant_equal_to_a_paper_value_is_a_listed_input_and_its_rows_are_marked():
    listed = {p.field for p in INPUTS}
    rows = _paper_values()
    assert len(rows) > 30
    for hw in PRESETS.values():
        for f in dataclasses.fields(hw):
            v = getattr(hw, f.name)
            if not isinstance(v, float) or v in (0.0, 1.0):
                continue
            for title, paper in rows:
                if math.isclose(v, paper, rel_tol=1e-3):
                    assert f.name in listed, f"{hw.name}.{f.name} = {v} is the paper's {title!r}: list it in paper_inputs"
                    assert echoed(title) is not None, f"{title!r} echoes {hw.name}.{f.name}: mark it"
    marked = [line for line in open(TABLES) if "echoes an input" in line]
    assert len(marked) == sum(len(p.rows) for p in INPUTS)
