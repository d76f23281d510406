"""A deployment's expert placement over time: the routed-load window always, and with
``--enable-eplb`` live rebalances, each in three phases that never stop serving:

1. *move*: every ``step_interval`` work items, a placement is computed from the window
   (``scheduler/eplb.py``, over the current one, so few slots change); if it is better, every
   expert-holding worker fills its other buffer with it on a copy thread (``MoveExperts``) while
   it goes on computing with the live one, and reports ``ExpertsMoved``;
2. *switch*: once all have, every attention-side process routes by the new placement from its
   next work item (``UseExperts``, in order on its pipe); dispatches carry the placement's parity,
   so items already in flight finish on the old buffers;
3. *retire*: once every work item issued before the switch is back, the old buffers are free, and
   the next rebalance may refill them.
"""
from __future__ import annotations

import dataclasses
import time

from moeflow.config import ONE_HOST_SHARED, ConfigError
from moeflow.engine.expert_load import ExpertLoadWindow, window_for
from moeflow.layout.expert_map import ExpertMap
from moeflow.logs import get_logger
from moeflow.messages import ExpertsMoved, MoveExperts, UseExperts, WorkDone
from moeflow.scheduler.eplb import rebalance
from moeflow.scheduler.expert_location import TRIVIAL, initial_map
from moeflow.workers.launch import WorkerDied

log = get_logger("moeflow.eplb")


@dataclasses.dataclass
class Rebalance:
    """One rebalance, as ``bench`` and the docs report it (engine-clock seconds)."""

    epoch: int
    started_s: float
    moved_slots: int  # (layer, slot) pairs whose expert changed
    balancedness_before: float  # mean over layers, of the window under the old / new placement
    balancedness_after: float
    switched_s: float | None = None
    retired_s: float | None = None
    move_s: float = 0.0  # slowest worker's copy time
    moved_bytes: int = 0  # summed over workers
    peer_bytes: int = 0  # of which read from peers (their shared memory, or over gloo from another host)


class Eplb:
    def __init__(self, engine, window: ExpertLoadWindow, expert_workers: list, attention_workers: list,
                 polls: bool, live: bool, config, num_nodes: int = 1, num_groups: int = 1):
        """``expert_workers``/``attention_workers``: handles to send to; ``polls``: read the expert
        workers' pipes here (False: they are the ranks the mode's loop reads, which hands their
        ``ExpertsMoved`` on through ``take``)."""
        self.engine, self.window, self.live, self.config = engine, window, live, config
        self.expert_workers, self.attention_workers, self.polls = expert_workers, attention_workers, polls
        self.num_nodes, self.num_groups = num_nodes, config.num_groups or num_groups
        self.epoch, self.since = 0, 0  # work items completed since the last rebalance was considered
        self.in_flight: set[int] = set()
        self.phase = "serving"  # serving | moving | retiring
        self._next: ExpertMap | None = None
        self._waiting: set[tuple[str, int]] = set()
        self._old: set[int] = set()  # work items issued before the switch, not yet back
        self.history: list[Rebalance] = []

    # -- the engine's hooks ----------------------------------------------------------------------

    def issued(self, work_id: int) -> None:
        self.in_flight.add(work_id)

    def completed(self, done: WorkDone) -> None:
        self.window.add(done.expert_load)
        self.in_flight.discard(done.work_id)
        self._old.discard(done.work_id)
        self.since += 1

    def take(self, got: list) -> list:
        """The mode's messages without the ``ExpertsMoved`` reports (kept here); then one turn of
        the state machine (reads the expert workers' pipes, when they are ours to read)."""
        if not self.live:
            return got
        rest = [(w, m) for w, m in got if not isinstance(m, ExpertsMoved) or self._moved(m)]
        if self.polls and self.phase == "moving":
            for _, m in self.engine.deployment.recv_any(self.expert_workers, 0.0):
                if not isinstance(m, ExpertsMoved) or self._moved(m):
                    log.warning("unexpected message from an expert worker: %r", m)
        self._advance()
        return rest

    def idle(self) -> str | None:
        """Nothing is in flight (a server calls this between requests): read the movers' reports
        here, so that a rebalance switches once its copies are done, not with the next request (a
        dep rank's pipe carries nothing else then; measured: 1.0 s -> 0.07 s with a request a
        second). Returns why a worker died, if one did meanwhile."""
        try:
            if self.live and self.phase != "serving":
                got = [] if self.polls else self.engine.deployment.recv_any(self.expert_workers, 0.0)
                for _, m in self.take(got):
                    log.warning("unexpected message from an expert worker: %r", m)
        except WorkerDied as e:
            return str(e)
        return None

    # -- the phases -------------------------------------------------------------------------------

    def _advance(self) -> None:
        if self.phase == "retiring" and not self._old:
            self.history[-1].retired_s = time.monotonic()
            self.phase = "serving"
        if self.phase == "serving" and self.since >= self.config.step_interval:
            self.since = 0
            self._start()

    def _start(self) -> None:
        load = self.window.window.tolist()
        if not any(any(row) for row in load):
            return
        now = self.window.map
        new = rebalance(load, now.num_devices, now.num_redundant, self.num_groups, self.num_nodes,
                        self.config.policy, current=now)
        moves = now.moves(new)
        if not moves:
            return
        before, after = now.balancedness(load), new.balancedness(load)
        self.history.append(Rebalance(self.epoch + 1, time.monotonic(), len(moves), sum(before) / len(before),
                                      sum(after) / len(after)))
        if self.config.log_balancedness:
            log.info("rebalance to placement %d: %d slots move; balancedness per layer %s -> %s", self.epoch + 1,
                     len(moves), [round(b, 3) for b in before], [round(a, 3) for a in after])
        self._next, self.phase = new, "moving"
        self._waiting = {(w.role, w.index) for w in self.expert_workers}
        for w in self.expert_workers:
            self.engine.deployment.send(w, MoveExperts(self.epoch + 1, new.layers))

    def _moved(self, m: ExpertsMoved) -> bool:
        """Count one worker's report; False (not ours) for a report of another placement."""
        if self.phase != "moving" or m.epoch != self.epoch + 1:
            return True
        self._waiting.discard((m.role, m.index))
        r = self.history[-1]
        r.move_s = max(r.move_s, m.seconds)
        r.moved_bytes, r.peer_bytes = r.moved_bytes + m.nbytes, r.peer_bytes + m.peer_bytes
        if not self._waiting:
            self._switch()
        return False

    def _switch(self) -> None:
        self.epoch += 1
        self.window.map = self._next
        for w in self.attention_workers:
            self.engine.deployment.send(w, UseExperts(self.epoch, self._next.layers))
        self._old = set(self.in_flight)
        self.history[-1].switched_s = time.monotonic()
        self.phase = "retiring"


def check_live(config, mode: str, computes: bool = True) -> None:
    """Refuse ``--enable-eplb`` where it cannot run, saying why (before anything starts)."""
    if not config.enable_eplb:
        return
    if not computes:
        raise ConfigError(f"--enable-eplb: mode {mode} has no placement to rebalance (dwdp ranks compute their own "
                          f"tokens with every expert; afd's topology 'block' gives every daemon all of them)")
    if config.transport not in ONE_HOST_SHARED:
        raise ConfigError("--enable-eplb moves expert weights through a weight store: shared memory within a host "
                          "and gloo across hosts (transport shm), or device memory (transport cuda-ipc); transport "
                          f"{config.transport!r} has none")


def start_placement(config, layout, mc, held: tuple, mode: str, computes: bool = True) -> tuple | ExpertMap:
    """The placement a deployment starts with: ``held`` (the layout's, the same in every MoE layer)
    or, with ``--init-expert-location FILE``, the file's (an ``ExpertMap``, by layer)."""
    if config.init_expert_location == TRIVIAL:
        return held
    if not computes:
        raise ConfigError(f"--init-expert-location: mode {mode} has no placement to choose (dwdp ranks compute their "
                          f"own tokens with every expert; afd's topology 'block' gives every daemon all of them)")
    if getattr(layout, "expert_placement", None) is not None:
        raise ConfigError("--init-expert-location: give either the layout's expert_placement or a starting "
                          "placement file, not both")
    moe = [lid for lid in range(mc.num_layers) if mc.sparse_layers[lid]]
    return initial_map(config.init_expert_location, held, mc.num_experts, moe, config.cluster.nnodes,
                       config.eplb_config.num_groups or mc.n_group, config.eplb_config.policy)


def attach(engine, mc, held, expert_workers: list, attention_workers: list, polls: bool, computes: bool = True) -> None:
    """Give ``engine`` (started) its load window and its placement over time."""
    c = engine.config
    engine.expert_load = window_for(mc, held, computes, c.eplb_config.window_size)
    engine.eplb = Eplb(engine, engine.expert_load, expert_workers, attention_workers, polls, c.enable_eplb,
                       c.eplb_config, c.cluster.nnodes, mc.n_group)


def point_report(eplb: Eplb, since: int, records: list) -> dict:
    """What a measured point says of the placement: the window's balancedness at its end (mean over
    layers), the rebalances that began during it, and its requests' latency split by whether their
    life overlapped a rebalance (move to retire) or not: a rebalance's latency cost."""
    bal = eplb.window.balancedness()
    out = {"eplb_balancedness": sum(bal) / len(bal) if bal else None,
           "eplb_rebalances": [dataclasses.asdict(r) for r in eplb.history[since:]]}
    spans = [(r.started_s, r.retired_s or float("inf")) for r in eplb.history[since:]]
    if not spans:
        return out
    during = [r for r in records if any(a < r.finished_s and r.arrival_s < b for a, b in spans)]
    outside = [r for r in records if r not in during]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    out["eplb_latency"] = {"requests_during": len(during), "requests_outside": len(outside),
                           "ttft_mean_s_during": mean(r.ttft_s for r in during),
                           "ttft_mean_s_outside": mean(r.ttft_s for r in outside),
                           "tpot_mean_s_during": mean(r.tpot_s for r in during),
                           "tpot_mean_s_outside": mean(r.tpot_s for r in outside)}
    return out


def summary(eplb: Eplb | None) -> dict | None:
    """A deployment's placement over a whole run (for result files)."""
    if eplb is None:
        return None
    bal = eplb.window.balancedness()
    return {"live": eplb.live, "physical_experts": eplb.window.map.num_slots, "epoch": eplb.epoch,
            "balancedness_per_layer": bal, "rebalances": [dataclasses.asdict(r) for r in eplb.history]}


