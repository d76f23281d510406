"""Expert holders that join and leave while the deployment serves: afd's FFN daemons N -> N'.

A change of membership is a rebalance whose placement has another device count (``eplb.py`` runs
its phases; ``scheduler/eplb.resize`` places it, moving as few weights as the change needs):

1. *move*: the daemons that join are forked (``Deployment.join``: started, not members, so that
   one that dies fails its join and not the deployment); each reads its slots of the new placement
   from the live daemons' published buffers (``JoinExperts``), while the survivors fill their other
   buffer with theirs (``MoveExperts``) and everyone goes on serving the old placement;
2. *switch*: once every survivor and joiner has reported ``ExpertsMoved``, the joiners become
   members and every attention instance routes by the new placement from its next step (its
   dispatches carry the placement's parity; an instance lets a leaving daemon's buffers go and
   writes a joining one's from its first message);
3. *retire*: once every work item issued before the switch is back, the leaving daemons are stopped.

A joiner that fails or dies before the switch ends the change: the survivors finish their moves,
nothing switches, the deployment serves on as it was, and the event says why. One change at a time.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from moeflow.config import ConfigError
from moeflow.scheduler.eplb import resized_counts


@dataclasses.dataclass
class ScaleEvent:
    """One membership change, as ``GET /scale`` and ``/metrics`` report it (engine-clock seconds)."""

    kind: str  # "ffn"
    before: int
    after: int
    requested_s: float
    switched_s: float | None = None  # the new membership serves from here
    left_s: float | None = None  # the last leaving member has exited (a scale-up: = switched_s)
    outcome: str = "running"  # running | done | failed: <why>
    moved_bytes: int = 0
    move_s: float = 0.0  # slowest member's copy time

    @property
    def seconds(self) -> float | None:
        """Request -> the new membership serving."""
        return None if self.switched_s is None else self.switched_s - self.requested_s


class Membership:
    """What changes an elastic deployment's expert holders: the engine's hooks and the change under way."""

    def __init__(self, kind: str, capacity: int, spawn: Callable, on_switch: Callable[[int], None]):
        """``spawn(index, JoinExperts)``: a joining worker's handle; ``on_switch(n)``: the engine's
        layout follows the new count."""
        self.kind, self.capacity, self.spawn, self.on_switch = kind, capacity, spawn, on_switch
        self.pending: int | None = None  # a target asked for, not yet begun
        self.joiners: list = []  # forked for the change under way
        self.ready: list = []  # of which started
        self.leavers: list = []
        self.failed: str | None = None
        self.events: list[ScaleEvent] = []

    @property
    def busy(self) -> bool:
        return self.pending is not None or (bool(self.events) and self.events[-1].outcome == "running")

    def ask(self, target: int, current: int, num_experts: int, slots: tuple[int, ...]) -> None:
        """Refuse a target that cannot be, saying why; else it begins at the next turn."""
        if self.busy:
            raise ConfigError(f"scale {self.kind}: a change to {self.pending or self.events[-1].after} is under way; "
                              f"ask again once GET /scale says it is done")
        if not 1 <= target <= self.capacity:
            raise ConfigError(f"scale {self.kind}: {target} is outside [1, {self.capacity}] (the deployment was started "
                              f"for at most {self.capacity}: max_ffn_workers)")
        held = sum(resized_counts(slots, target))
        if held < num_experts:
            raise ConfigError(f"scale {self.kind}: {target} daemons of {slots[-1]} slots hold {held} experts, fewer than "
                              f"the model's {num_experts}")
        if target != current:
            self.pending = target

    def fail(self, why: str) -> None:
        self.failed = self.failed or why

    def status(self, current: int) -> dict:
        last = self.events[-1] if self.events else None
        return {self.kind: current, "capacity": self.capacity,
                "target": self.pending if self.pending is not None else (last.after if last and last.outcome == "running"
                                                                        else current),
                "in_progress": self.busy, "events": [dataclasses.asdict(e) | {"seconds": e.seconds} for e in self.events]}


def check_elastic(config, layout) -> None:
    """Refuse an elastic layout where members cannot join, saying why (before anything starts)."""
    if not getattr(layout, "elastic", False):
        return
    if config.transport not in ("shm", "shm-handshake"):
        raise ConfigError(f"max_ffn_workers: FFN daemons join through host shared memory (transport shm), not "
                          f"{config.transport!r}")
    if config.cluster.is_multinode:
        raise ConfigError("max_ffn_workers: FFN daemons join on the engine's host; this deployment spans hosts")

