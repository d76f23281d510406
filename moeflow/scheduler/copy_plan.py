"""DWDP's copy plans: what a rank pulls from which peer for one MoE layer, in what order.

Pure Python (the simulator prices the very same plans). A rank lacks some experts of each layer;
each lacking expert comes from one peer that holds it (replicas spread by destination and expert).
A *unit* is one expert's tensor of one kind (gate/up or down), contiguous in its source's memory.

- ``naive``: whole units, one source after another: many ranks pulling at once tend to queue on
  the same source (DWDP §4.3: contention C = 1 + Binomial(N - 2, 1/(N - 1))).
- ``sliced``: every unit cut into ``slice_bytes`` slices; the rank takes one slice from each of
  its sources in turn, starting from a different source than its neighbours, so a source serves
  the slices of all the ranks pulling from it round-robin and no single pull blocks the others
  (DWDP §4.3.2, Listing 1).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    src: int  # the rank whose resident experts are read
    unit: str  # which tensor: "w13" (gate and up) or "w2" (down)
    expert: int  # global expert id
    offset: int  # bytes into the unit
    nbytes: int


def sources(placement: tuple[tuple[int, ...], ...], dst: int, num_experts: int) -> dict[int, list[int]]:
    """The peers ``dst`` pulls from, and which of its lacking experts from each (in expert order):
    a replicated expert comes from holder (dst + expert) mod copies, so ranks spread over replicas."""
    holders: dict[int, list[int]] = {}
    for rank, ids in enumerate(placement):
        for e in ids:
            holders.setdefault(e, []).append(rank)
    out: dict[int, list[int]] = {}
    for e in range(num_experts):
        if e in placement[dst]:
            continue
        peers = [r for r in holders[e] if r != dst]
        out.setdefault(peers[(dst + e) % len(peers)], []).append(e)
    return dict(sorted(out.items()))


def _units(experts: list[int], unit_bytes: dict[str, int]) -> list[tuple[str, int]]:
    return [(u, e) for u in unit_bytes for e in experts]


def copy_plan(placement: tuple[tuple[int, ...], ...], dst: int, num_experts: int, unit_bytes: dict[str, int],
              kind: str = "sliced", slice_bytes: int = 1 << 20) -> list[Slice]:
    """``dst``'s pulls for one layer, in issue order. ``unit_bytes``: bytes of each unit kind."""
    src_experts = sources(placement, dst, num_experts)
    if kind == "naive":
        return [Slice(s, u, e, 0, unit_bytes[u]) for s, ex in src_experts.items() for u, e in _units(ex, unit_bytes)]
    if kind != "sliced":
        raise ValueError(f"copy plan must be 'sliced' or 'naive', got {kind!r}")
    streams = []
    for s, ex in src_experts.items():
        streams.append([Slice(s, u, e, off, min(slice_bytes, unit_bytes[u] - off))
                        for u, e in _units(ex, unit_bytes) for off in range(0, unit_bytes[u], slice_bytes)])
    # start at the first source after dst: neighbouring ranks begin on different sources
    start = next((i for i, st in enumerate(streams) if st[0].src > dst), 0)
    streams = streams[start:] + streams[:start]
    plan, depth = [], max((len(st) for st in streams), default=0)
    for i in range(depth):  # one slice from each source in turn
        plan += [st[i] for st in streams if i < len(st)]
    return plan


def source_order(plans: dict[int, list[Slice]], src: int) -> list[tuple[int, Slice]]:
    """The order ``src`` serves the slices every destination asked it for when it serves their queues
    round-robin, one slice per destination per round: [(dst, slice), ...]."""
    queues = {d: [s for s in plan if s.src == src] for d, plan in sorted(plans.items())}
    out, depth = [], max((len(q) for q in queues.values()), default=0)
    for i in range(depth):
        out += [(d, q[i]) for d, q in queues.items() if i < len(q)]
    return out
