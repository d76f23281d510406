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
from moeflow.engine.scale_event import ScaleEvent
from moeflow.layout.expert_map import ExpertMap
from moeflow.logs import get_logger
from moeflow.membership_messages import JoinExperts
from moeflow.messages import ExpertsMoved, MoveExperts, UseExperts, WorkDone, WorkerFailed
from moeflow.scheduler.eplb import rebalance, resize
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
        self.rebalances = live  # periodic rebalances (--enable-eplb); an elastic deployment moves without them
        self.membership = None  # an elastic deployment's (engine/elastic.py): members that join and leave

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
        if self.membership is not None and self.phase == "moving":
            self._poll_joiners()
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
            if self.live and (self.phase != "serving" or (self.membership is not None and self.membership.pending)):
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
            if self.membership is not None:
                self._retire_leavers()
        m = self.membership
        if self.phase == "serving" and m is not None and m.pending is not None and m.may_begin(m.pending):
            self._resize()
        elif self.phase == "serving" and self.rebalances and self.since >= self.config.step_interval:
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
            self._moves_done()
        return False

    def _moves_done(self) -> None:
        m = self.membership
        if m is not None and m.failed is not None:  # a joiner failed: nothing switches, the rest serve on
            m.events[-1].outcome = f"failed: {m.failed}"
            self.history[-1].retired_s = time.monotonic()
            for w in m.joiners:  # asked to shut down: each unlinks its own buffers
                self.engine.deployment.leave(w)
            m.joiners, m.ready, m.leavers, m.failed, self.phase = [], [], [], None, "serving"
            log.warning("scale %s: %s", m.kind, m.events[-1].outcome)
            return
        self._switch()

    def _switch(self) -> None:
        self.epoch += 1
        self.window.map = self._next
        m = self.membership
        if m is not None:
            for w in m.joiners:
                self.engine.deployment.admit(w)
                self.expert_workers.append(w)
            m.joiners, m.ready = [], []
            m.on_switch(self._next.num_devices)
        for w in self.attention_workers:
            self.engine.deployment.send(w, UseExperts(self.epoch, self._next.layers))
        self._old = set(self.in_flight)
        self.history[-1].switched_s = time.monotonic()
        if m is not None and m.events and m.events[-1].outcome == "running":
            e = m.events[-1]
            e.switched_s, e.moved_bytes, e.move_s = self.history[-1].switched_s, self.history[-1].moved_bytes, \
                self.history[-1].move_s
        self.phase = "retiring"

    # -- membership (elastic.py) ------------------------------------------------------------------

    def _resize(self) -> None:
        """Begin the change to ``membership.pending`` devices: joiners forked, survivors moving."""
        m, now = self.membership, self.window.map
        n, cur = m.pending, now.num_devices
        m.pending = None
        load = self.window.window.tolist()
        new = resize(now, n, load)
        started = time.monotonic()
        m.events.append(ScaleEvent(m.kind, cur, n, m.asked_s or started))
        moved = sum(a != b for l in range(now.num_layers) for d in range(min(n, cur))
                    for a, b in zip(now.layers[l][d], new.layers[l][d])) + sum(new.slots_per_device[cur:]) * now.num_layers
        before, after = now.balancedness(load), new.balancedness(load)
        self.history.append(Rebalance(self.epoch + 1, started, moved, sum(before) / len(before), sum(after) / len(after)))
        survivors = self.expert_workers[:min(n, cur)]
        m.leavers = list(self.expert_workers[n:])
        m.joiners = [m.spawn(j, JoinExperts(self.epoch + 1, new.layers, now.layers)) for j in range(cur, n)]
        self._next, self.phase = new, "moving"
        self._waiting = {(w.role, w.index) for w in survivors + m.joiners}
        log.info("scale %s %d -> %d: %d slots move", m.kind, cur, n, moved)
        for w in survivors:
            self.engine.deployment.send(w, MoveExperts(self.epoch + 1, new.layers))

    def _poll_joiners(self) -> None:
        """The joiners' start and reports (their pipes are not the deployment's yet); one that failed
        or died ends the change once the survivors' moves are in."""
        m = self.membership
        for w in list(m.joiners):
            try:
                if not any(x is w for x in m.ready):
                    if not self.engine.deployment.is_ready(w):
                        continue
                    m.ready.append(w)
                while w.conn.poll(0):
                    msg = w.conn.recv()
                    if isinstance(msg, ExpertsMoved):
                        self._moved(msg)
                    elif isinstance(msg, WorkerFailed):
                        raise WorkerDied(f"{w.name} failed:\n{msg.error}", w)
                if not w.process.is_alive():
                    raise WorkerDied(f"{w.name} exited (exit code {w.process.exitcode})", w)
            except (WorkerDied, EOFError, OSError) as e:
                m.fail(str(e).splitlines()[0])
                m.joiners = [x for x in m.joiners if x is not w]
                self.engine.deployment.leave(w, 0.0)
                self._waiting.discard((w.role, w.index))
                if not self._waiting:
                    self._moves_done()
                    return

    def _retire_leavers(self) -> None:
        m = self.membership
        for w in m.leavers:
            self.expert_workers.remove(w)
            self.engine.deployment.leave(w)
        if m.events and m.events[-1].outcome == "running":
            m.events[-1].left_s, m.events[-1].outcome = time.monotonic(), "done"
            log.info("scale %s %d -> %d done in %.2f s", m.kind, m.events[-1].before, m.events[-1].after,
                     m.events[-1].left_s - m.events[-1].requested_s)
        m.leavers = []


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
