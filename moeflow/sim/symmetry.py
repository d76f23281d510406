"""The modelling choices of one run, and which of them differ between its systems.

A comparison is only as fair as its modelling: a choice (how attention is split, the all-to-all's
bandwidth, compute jitter, expert skew, host overheads) is the same for every system of a run
unless the paper's text says that system differs, and then the config cites the text beside it
(``sim: {differs: {choice: "the paper's words, section"}}``). ``simulate`` prints every choice
that differs and why; a difference without a citation is printed as such, and the tests refuse it
in the repository's configs.

What counts as a choice: every ``sim:`` option except the random seeds (``expert_seed`` and
``seed`` draw the same way for every system) and ``differs`` itself; a choice only some modes read
is compared among the systems of those modes (a pd deployment counts for every mode). Layout fields
are what is compared, not choices. Pure Python.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

NOT_CHOICES = ("expert_seed", "seed", "differs")
# the modes whose simulation reads a choice (the rest read every one): sim/asap.py, dep.py, dwdp.py
READ_BY = {"super_kernel": ("asap", "dep"), "comm_overlap": ("asap",), "resident_experts": ("dwdp",),
           "dedup_dispatch": ("dep",)}


@dataclass(frozen=True)
class Difference:
    system: str
    choice: str
    value: object
    usual: object  # what most systems of the run take (the first system's, on a tie)
    reason: str | None  # the config's citation; None: none given


def choices(sim) -> dict[str, object]:
    """A system's modelling choices (``SimOptions``' fields less ``NOT_CHOICES``)."""
    return {f.name: getattr(sim, f.name) for f in fields(sim) if f.name not in NOT_CHOICES}


def differences(systems: dict) -> list[Difference]:
    """Every (system, choice) whose value is not the one most of ``systems`` (name -> SystemSpec) take."""
    names = list(systems)
    by_system = {n: choices(systems[n].sim) for n in names}
    out = []
    for choice in (by_system[names[0]] if names else {}):
        modes = READ_BY.get(choice)
        these = [n for n in names if modes is None or systems[n].layout.mode in modes + ("pd",)]
        values = [by_system[n][choice] for n in these]
        if len(set(map(repr, values))) < 2:
            continue
        counts = Counter(map(repr, values))
        top = max(counts.values())
        usual = next(v for v in values if counts[repr(v)] == top)
        for n, v in zip(these, values):
            if repr(v) != repr(usual):
                reason = dict(getattr(systems[n].sim, "differs", ()) or ()).get(choice)
                out.append(Difference(n, choice, v, usual, reason))
    return out


def unjustified(diffs: list[Difference]) -> list[Difference]:
    return [d for d in diffs if not d.reason]


def report(diffs: list[Difference]) -> str:
    """The lines ``simulate`` prints before its results."""
    if not diffs:
        return "modelling choices: the same for every system"
    lines = ["modelling choices that differ between systems (each with the paper's reason, or none given):"]
    for d in diffs:
        why = d.reason or "NO REASON GIVEN: the comparison favours one side"
        lines.append(f"  {d.system}: {d.choice} = {d.value!r} (the others: {d.usual!r}): {why}")
    return "\n".join(lines)
