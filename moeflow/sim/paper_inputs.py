"""The simulator's constants that are a seed paper's own results, and the seed-table rows that only
echo them: such a row is not a prediction, and the tables say so.

A hardware preset may take a number a paper measured (ASAP's 220 µs of host dispatch per layer,
FastAFD's 9.8 ms of host work per step, DWDP's 1.226x copy slowdown) when nothing else gives it;
the rows that then reproduce that number, or the paper's own arithmetic on it, are marked "echoes"
in ``docs/results/sim/seed_tables.md``. ``tests/unit/test_paper_inputs.py`` checks that every
preset constant equal to a table's paper value is listed here. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperInput:
    field: str  # the Hardware field (sim/hardware.py)
    value: float  # in the field's unit (seconds, a ratio)
    source: str
    rows: tuple[str, ...]  # the seed-table rows (their first words) that echo it


INPUTS = (
    PaperInput("host_dispatch_s", 220e-6, "ASAP §5.5: host kernel dispatch, 220 µs per MoE layer on CloudMatrix384",
               ("§5.5: super kernel, TTFT saved at 1 rps",)),
    PaperInput("host_step_s", 9.8e-3, "FastAFD §5: overlap scheduling takes 9.8 ms off every decode step",
               ("§5 overlap scheduling, TPOT saved",)),
    PaperInput("copy_slowdown", 1.226, "DWDP Appendix A, Table 7: an attention kernel under copy-engine overlap",
               ()),
)


def echoed(row_title: str) -> PaperInput | None:
    """The input a seed-table row echoes (None: the row is a prediction)."""
    return next((p for p in INPUTS for r in p.rows if row_title.startswith(r)), None)
