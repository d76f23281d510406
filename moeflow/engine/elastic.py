"""Expert holders that join and leave while the deployment serves: afd's FFN daemons N -> N', asap's
MoE workers E -> E'.

A change of membership is a rebalance whose placement has another device count (``eplb.py`` runs
its phases; ``scheduler/eplb.resize`` places it, moving as few weights as the change needs):

1. *move*: the workers that join are forked (``Deployment.join``: started, not members, so that
   one that dies fails its join and not the deployment); each reads its slots of the new placement
   from the live workers' published buffers (``JoinExperts``), while the survivors fill their other
   buffer with theirs (``MoveExperts``) and everyone goes on serving the old placement;
2. *switch*: once every survivor and joiner has reported ``ExpertsMoved``, the joiners become
   members and every attention instance routes by the new placement from its next step (its
   dispatches carry the placement's parity; an instance lets a leaving daemon's buffers go and
   writes a joining one's from its first message);
3. *retire*: once every work item issued before the switch is back, the leaving workers are stopped.

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

    kind: str  # "ffn" | "moe"
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

    def __init__(self, kind: str, capacity: int, spawn: Callable, on_switch: Callable[[int], None],
                 option: str = "max_ffn_workers"):
        """``spawn(index, JoinExperts)``: a joining worker's handle; ``on_switch(n)``: the engine's
        layout follows the new count; ``option``: the layout's name for ``capacity``."""
        self.kind, self.capacity, self.spawn, self.on_switch, self.option = kind, capacity, spawn, on_switch, option
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
                              f"for at most {self.capacity}: {self.option})")
        held = sum(resized_counts(slots, target))
        if held < num_experts:
            raise ConfigError(f"scale {self.kind}: {target} {self.kind} workers of {slots[-1]} slots hold {held} "
                              f"experts, fewer than the model's {num_experts}")
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


class ElasticExperts:
    """An engine whose expert holders may join and leave (a mixin of ``ProcessEngine``s whose layout
    names them: ``expert_kind``, ``expert_count``, ``expert_max``, ``expert_capacity``)."""

    def _elastic(self) -> None:
        """Once built: an elastic layout's membership rides on the placement over time (eplb.py)."""
        lay = self.layout
        if lay.elastic:
            self.eplb.live = True
            self.eplb.membership = Membership(lay.expert_kind, lay.expert_capacity, self._join_expert,
                                              self._experts_switched, lay.expert_max)

    def _refuse(self) -> None:
        check_elastic(self.config, self.layout)

    def scale(self, ffn: int | None = None, moe: int | None = None, attention: int | None = None,
              ep_size: int | None = None) -> dict:
        """Ask for a number of expert holders (``ep_size``, or the mode's own name: afd ``ffn``, asap
        ``moe``); it begins at the next turn and ``scale_status`` follows it. Refused with the reason
        where it cannot be."""
        lay, kind = self.layout, self.layout.expert_kind
        if attention is not None and attention != self.attention_count:
            raise ConfigError(f"scale attention: {self.mode_name}'s attention side is fixed while serving here "
                              f"({self.attention_count}); its {kind} workers scale ({kind}, ep_size)")
        asked = {"ffn": ffn, "moe": moe}
        other = [k for k, v in asked.items() if v is not None and k != kind]
        if other:
            raise ConfigError(f"scale {other[0]}: mode {self.mode_name} has no {other[0]} workers; its expert "
                              f"holders are {kind} ({kind}, ep_size)")
        target = asked[kind]
        if target is not None and ep_size is not None and target != ep_size:
            raise ConfigError(f"scale: {kind}={target} and ep_size={ep_size} disagree (they name the same workers)")
        target = target if target is not None else ep_size
        m = self.eplb.membership
        if target is None:
            return self.scale_status()
        if m is None:
            raise ConfigError(f"scale {kind}: this deployment's {kind} workers are fixed; start it with "
                              f"{lay.expert_max} (--{lay.expert_max.replace('_', '-')}) to scale them while serving")
        now = self.eplb.window.map
        m.ask(target, now.num_devices, self.model_config.num_experts, now.slots_per_device)
        return self.scale_status()

    @property
    def attention_count(self) -> int:
        return self.layout.num_processes - getattr(self.layout, self.layout.expert_count)

    def scale_status(self) -> dict:
        m, lay = self.eplb.membership, self.layout
        n = getattr(lay, lay.expert_count)
        if m is None:
            return {lay.expert_kind: n, "capacity": n, "in_progress": False, "events": []}
        return m.status(n)

    def load(self):
        x, m = super().load(), self.eplb.membership
        if m is None:
            return x
        counts: dict[tuple[str, str], int] = {}
        for e in m.events:
            if e.outcome == "running":  # counted once it ends (a counter never goes down)
                continue
            key = (e.kind, e.outcome.split(":")[0])
            counts[key] = counts.get(key, 0) + 1
        lay = self.layout
        return dataclasses.replace(x, members=(("attention", self.attention_count),
                                               (lay.expert_kind, getattr(lay, lay.expert_count))),
                                   scale_events=tuple((k, o, c) for (k, o), c in sorted(counts.items())))

    def _join_expert(self, index: int, join) -> object:
        """Fork expert holder ``index`` to join with placement ``join`` (its world rank follows the
        attention side's, as at start)."""
        lay = self.layout
        layout = dataclasses.replace(lay, **{lay.expert_count: len(join.layers[0])})
        role = lay.expert_kind
        # NOTE: world None: an expert holder talks through shared memory only (check_elastic), and the
        # attention side's TP world (asap attn_tp > 1) was formed without it
        setup = dataclasses.replace(self._worker_setup(role, index, self.attention_count + index, 0),
                                    layout=layout, join=join, expert_layers=None, world=None)
        return self.deployment.join(setup)

    def _experts_switched(self, n: int) -> None:
        self.layout = dataclasses.replace(self.layout, **{self.layout.expert_count: n})


def check_elastic(config, layout) -> None:
    """Refuse an elastic layout where members cannot join, saying why (before anything starts)."""
    if not getattr(layout, "elastic", False):
        return
    who = {"ffn": "FFN daemons", "moe": "MoE workers"}[layout.expert_kind]
    if config.transport not in ("shm", "shm-handshake"):
        raise ConfigError(f"{layout.expert_max}: {who} join through host shared memory (transport shm), not "
                          f"{config.transport!r}")
    if config.cluster.is_multinode:
        raise ConfigError(f"{layout.expert_max}: {who} join on the engine's host; this deployment spans hosts")
