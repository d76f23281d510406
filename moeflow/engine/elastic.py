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
import glob
import os
import time
from collections.abc import Callable

from moeflow.comm.segment import SHM_DIR, segment_path
from moeflow.comm.space import check_room
from moeflow.config import ConfigError
from moeflow.engine.scale_event import ScaleEvent, event_counts, scale_event
from moeflow.membership_messages import ForgetRegion
from moeflow.messages import UseExperts
from moeflow.scheduler.eplb import resized_counts


class Membership:
    """What changes an elastic deployment's expert holders: the engine's hooks and the change under way."""

    def __init__(self, kind: str, capacity: int, spawn: Callable, on_switch: Callable[[int], None],
                 option: str = "max_ffn_workers"):
        """``spawn(index, JoinExperts)``: a joining worker's handle; ``on_switch(n)``: the engine's
        layout follows the new count; ``option``: the layout's name for ``capacity``."""
        self.kind, self.capacity, self.spawn, self.on_switch, self.option = kind, capacity, spawn, on_switch, option
        self.pending: int | None = None  # a target asked for, not yet begun
        self.asked_s: float | None = None  # when it was asked for
        # whether the change to ``pending`` may begin now (dep: its leaving ranks have drained first)
        self.may_begin: Callable[[int], bool] = lambda target: True
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
            self.pending, self.asked_s = target, time.monotonic()

    def fail(self, why: str) -> None:
        self.failed = self.failed or why

    def status(self, current: int) -> dict:
        last = self.events[-1] if self.events else None
        return {self.kind: current, "capacity": self.capacity,
                "target": self.pending if self.pending is not None else (last.after if last and last.outcome == "running"
                                                                        else current),
                "in_progress": self.busy, "events": [scale_event(e) for e in self.events]}


class ElasticExperts:
    """An engine whose expert holders may join and leave (a mixin of ``ProcessEngine``s whose layout
    names them: ``expert_kind``, ``expert_count``, ``expert_max``, ``expert_capacity``)."""

    attention_groups = None  # asap with max_attn_dp: its groups join and leave (elastic_attention.py)

    def _elastic(self, attention_groups=None) -> None:
        """Once built: an elastic layout's expert holders ride on the placement over time (eplb.py);
        ``attention_groups``: an elastic attention side's change of membership."""
        lay = self.layout
        if lay.elastic:
            self.eplb.live = True
            self.eplb.membership = Membership(lay.expert_kind, lay.expert_capacity, self._join_expert,
                                              self._experts_switched, lay.expert_max)
        self.attention_groups = attention_groups

    def _instances_served(self, count: int) -> bool:
        """Whether the expert side serves attention groups 0..count-1 now (asap's serves any region that
        writes); a mode whose expert side aggregates its instances (afd) tells it first."""
        return True

    def _idle_group(self, group: int) -> bool:
        """Whether nothing of ``group``'s is on the workers beyond what ``_inflight`` says (afd: steps)."""
        return True

    def _attention_segments(self) -> list[str]:
        """What a live attention group publishes in /dev/shm (segment names): its combine buffers, and
        its KV cache where shared; a joiner will too."""
        spec = self.deployment.setups[0].comm.spec
        return [f"combine{spec.lane_id(0, j)}" for j in range(spec.lanes_per_region)] + [
            f"kv-cache-{self.layout.attention_role}0-*"]

    def _attention_joiner(self, group: int, member: int, world):
        """The setup of member ``member`` of attention group ``group``, joining (``world``: its group's
        own, or None): the deployment's layout at that size and the placement routed by now."""
        now, lay, t = self.eplb.window.map, self.layout, getattr(self.layout, "attn_tp", 1)
        layout = dataclasses.replace(lay, **{lay.attention_count: group + 1, lay.expert_count: now.num_devices})
        base = self._worker_setup(lay.attention_role, group * t + member, group * t + member, 0)
        return dataclasses.replace(base, layout=layout, world=world, world_rank=member,
                                   experts_held=now.layers[0], expert_layers=now.layers)

    def _attention_admitted(self, w) -> None:
        """A joined attention process is a member now: it is sent the placement routed by now, read
        before its first work item (a switch from now on reaches it as every member)."""
        self.deployment.send(w, UseExperts(self.eplb.epoch, self.eplb.window.map.layers))

    def _regions_left(self, regions: list[int]) -> None:
        """The expert holders forget the regions of groups that left (their workers have stopped: no
        reply to them is left to send)."""
        for w in self.eplb.expert_workers:
            for g in regions:
                self.deployment.send(w, ForgetRegion(g))

    def check_workers(self):
        """As every deployment; and an attention change goes on while the deployment is idle."""
        result = super().check_workers()
        if self.attention_groups is not None and self.failed is None:
            self.attention_groups.turn()
        return result

    def _refuse(self) -> None:
        check_elastic(self.config, self.layout)

    def scale(self, ffn: int | None = None, moe: int | None = None, attention: int | None = None,
              ep_size: int | None = None, drain: bool | None = None) -> dict:
        """Ask for a number of expert holders (``ep_size``, or the mode's own name: afd ``ffn``, asap
        ``moe``), or of attention groups (``attention``; ``drain``: a leaver's residents finish there
        rather than being handed over); it begins at the next turn and ``scale_status`` follows it.
        Refused with the reason where it cannot be."""
        lay, kind, m, ag = self.layout, self.layout.expert_kind, self.eplb.membership, self.attention_groups
        if attention is not None and attention != self.attention_count:
            if ag is None:
                opt = getattr(lay, "attention_max", None)
                raise ConfigError(f"scale attention: this deployment's attention side is fixed while serving "
                                  f"({self.attention_count})" + (f"; start it with {opt} (--{opt.replace('_', '-')}) "
                                                                 f"to scale it" if opt else ""))
            if any(x is not None for x in (ffn, moe, ep_size)):
                raise ConfigError("scale: one change at a time; give attention or the expert holders, not both")
            if not ag.busy and attention <= ag.capacity:  # else ask says why not
                check_joiners_fit(self.deployment_id, self._attention_segments(), attention - self.attention_count,
                                  f"scale attention {self.attention_count} -> {attention}")
            ag.ask(attention, self.attention_count, m is not None and m.busy, drain)
            return self.scale_status()
        asked = {"ffn": ffn, "moe": moe}
        other = [k for k, v in asked.items() if v is not None and k != kind]
        if other:
            raise ConfigError(f"scale {other[0]}: mode {self.mode_name} has no {other[0]} workers; its expert "
                              f"holders are {kind} ({kind}, ep_size)")
        target = asked.get(kind)  # dep's ranks have no name of their own: ep_size
        if target is not None and ep_size is not None and target != ep_size:
            raise ConfigError(f"scale: {kind}={target} and ep_size={ep_size} disagree (they name the same workers)")
        target = target if target is not None else ep_size
        if target is None:
            return self.scale_status()
        if ag is not None and ag.busy:
            raise ConfigError("scale: an attention change is under way; ask again once GET /scale says it is done")
        if m is None:
            raise ConfigError(f"scale {kind}: this deployment's {kind} workers are fixed; start it with "
                              f"{lay.expert_max} (--{lay.expert_max.replace('_', '-')}) to scale them while serving")
        now = self.eplb.window.map
        spec = self.deployment.setups[0].comm.spec  # an expert holder publishes its dispatch buffer and slots
        if not m.busy and target <= m.capacity:  # else ask says why not
            check_joiners_fit(self.deployment_id, ["dispatch0", f"weights{spec.expert_world_rank(0)}"],
                              target - now.num_devices, f"scale {kind} {now.num_devices} -> {target}")
        m.ask(target, now.num_devices, self.model_config.num_experts, now.slots_per_device)
        return self.scale_status()

    @property
    def attention_count(self) -> int:
        """Attention groups (asap's DP groups, afd's instances) now."""
        return getattr(self.layout, self.layout.attention_count)

    def scale_status(self) -> dict:
        m, lay, ag = self.eplb.membership, self.layout, self.attention_groups
        n = getattr(lay, lay.expert_count)
        out = m.status(n) if m is not None else {lay.expert_kind: n, "capacity": n, "in_progress": False, "events": []}
        if ag is not None:
            out = out | {"attention": self.attention_count, "attention_capacity": ag.capacity,
                         "in_progress": out["in_progress"] or ag.busy,
                         "events": sorted(out["events"] + [scale_event(e) for e in ag.events],
                                          key=lambda e: e["requested_s"])}
            if ag.busy:
                out["attention_target"] = ag.pending if ag.pending is not None else ag.events[-1].after
        return out

    def load(self):
        x, m, ag = super().load(), self.eplb.membership, self.attention_groups
        if m is None and ag is None:
            return x
        lay = self.layout
        return dataclasses.replace(x, members=(("attention", self.attention_count),
                                               (lay.expert_kind, getattr(lay, lay.expert_count))),
                                   scale_events=event_counts((m.events if m is not None else []) +
                                                             (ag.events if ag is not None else [])))

    def _join_expert(self, index: int, join) -> object:
        """Fork expert holder ``index`` to join with placement ``join`` (its world rank follows the
        attention side's, as at start)."""
        lay = self.layout
        layout = dataclasses.replace(lay, **{lay.expert_count: len(join.layers[0])})
        role = lay.expert_kind
        # NOTE: world None: an expert holder talks through shared memory, or pair links across hosts
        # (check_elastic), and the attention side's TP world (asap attn_tp > 1) was formed without it
        rank = self.layout.num_processes - getattr(lay, lay.expert_count) + index  # after the attention side's
        nodes = self.deployment.setups[0].comm.rank_nodes
        setup = dataclasses.replace(self._worker_setup(role, index, rank, nodes[rank] if nodes else 0),
                                    layout=layout, join=join, expert_layers=None, world=None)
        return self.deployment.join(setup)

    def _experts_switched(self, n: int) -> None:
        self.layout = dataclasses.replace(self.layout, **{self.layout.expert_count: n})


def check_joiners_fit(deployment_id: str, names: list[str], count: int, what: str) -> None:
    """Refuse ``count`` new members when /dev/shm cannot hold what a live one of their kind publishes
    there (its segments ``names``, globs of this deployment's), saying how much is missing."""
    if count <= 0:
        return
    each = sum(os.path.getsize(f) for n in names for f in glob.glob(segment_path(deployment_id, n)))
    check_room(SHM_DIR, count * each, what)


def check_elastic(config, layout) -> None:
    """Refuse an elastic layout where members cannot join, saying why (before anything starts)."""
    options = [o for o in (layout.expert_max, getattr(layout, "attention_max", None))
               if o is not None and getattr(layout, o, None) is not None]
    if not options:
        return
    if config.transport not in ("shm", "shm-handshake"):
        raise ConfigError(f"{options[0]}: workers join through host shared memory (transport shm), not "
                          f"{config.transport!r}")
    cluster = config.cluster
    if cluster.is_multinode:
        if options[0] != layout.expert_max or len(options) > 1:
            raise ConfigError(f"{[o for o in options if o != layout.expert_max][0]}: attention members join on the "
                              f"engine's host only; this deployment spans hosts" + (
                                  f" (its expert holders may scale: {layout.expert_max})" if layout.expert_max else ""))
        if config.transport != "shm":
            raise ConfigError(f"{options[0]}: across hosts members join through shm and pair links (transport "
                              f"shm), not {config.transport!r}")
        if cluster.nnodes > 2:
            raise ConfigError(f"{options[0]}: an elastic deployment's expert holders share one host (a joiner "
                              f"reads its experts from its peers' shared memory); this cluster spreads them over "
                              f"{cluster.nnodes - 1} hosts: run it on 2 nodes")
