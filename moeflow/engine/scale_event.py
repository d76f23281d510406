"""One membership change of an elastic deployment, as ``GET /scale`` and ``/metrics`` report it."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ScaleEvent:
    """One membership change, as ``GET /scale`` and ``/metrics`` report it (engine-clock seconds)."""

    kind: str  # "ffn" | "moe"
    before: int
    after: int
    requested_s: float
    switched_s: float | None = None  # the new membership serves from here
    left_s: float | None = None  # the last leaving member has exited (a scale-up: = switched_s)
    outcome: str = "running"  # running | done | failed: <why>
    moved_bytes: int = 0
    move_s: float = 0.0  # slowest member's copy time
    handed: int = 0  # attention: the leavers' requests handed to the groups that stay (their KV copied)

    @property
    def seconds(self) -> float | None:
        """Request -> the new membership serving."""
        return None if self.switched_s is None else self.switched_s - self.requested_s


def event_counts(events: list[ScaleEvent]) -> tuple[tuple[str, str, int], ...]:
    """(kind, outcome, count) of the changes that ended, for ``/metrics`` (a counter never goes down, so a
    change counts once it ends)."""
    counts: dict[tuple[str, str], int] = {}
    for e in events:
        if e.outcome != "running":
            key = (e.kind, e.outcome.split(":")[0])
            counts[key] = counts.get(key, 0) + 1
    return tuple((k, o, c) for (k, o), c in sorted(counts.items()))


def scale_event(e: ScaleEvent) -> dict:
    """One event as ``GET /scale`` reports it."""
    return dataclasses.asdict(e) | {"seconds": e.seconds}
