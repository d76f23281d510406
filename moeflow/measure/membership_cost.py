"""What an elastic deployment's members cost: process-seconds, each member from its start to its exit
(the simulator's ``process_s`` in ``sim/elastic_afd.py`` counts the same way). Pure Python.

A joiner is a process from the moment it is asked for (it is started then, and costs while it loads
its weights), a leaver until it has exited; a change that failed is left out (its joiner died, when is
not reported). Events are ``GET /scale``'s, on the server's clock.
"""
from __future__ import annotations


def process_seconds(members_at_start: int, events: list[dict], t0_s: float, t1_s: float,
                    per_member: dict[str, int] | None = None) -> float:
    """Process-seconds of a deployment over [``t0_s``, ``t1_s``] that had ``members_at_start`` processes at
    ``t0_s`` and then changed by ``events`` (``kind``, ``before``, ``after``, ``requested_s``, ``left_s``,
    ``switched_s``, ``outcome``); events asked for before ``t0_s`` are in ``members_at_start`` already.
    ``per_member``: the processes one member of a kind is (a pd instance's); 1 where not given."""
    if not t1_s >= t0_s:
        raise ValueError(f"process_seconds: need t1_s >= t0_s, got {t0_s} and {t1_s}")
    total = members_at_start * (t1_s - t0_s)
    for e in events:
        if e["outcome"].startswith("failed") or not t0_s <= e["requested_s"] <= t1_s:
            continue
        n = (e["after"] - e["before"]) * (per_member or {}).get(e.get("kind"), 1)
        if n > 0:
            total += n * (t1_s - e["requested_s"])
        elif n < 0:
            gone = e["left_s"] if e["left_s"] is not None else e["switched_s"]
            total -= -n * (t1_s - min(t1_s, gone)) if gone is not None else 0.0
    return total
