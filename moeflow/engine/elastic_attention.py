"""Attention groups that join and leave while the deployment serves: asap's D -> D' and
afd's attention instances M -> M' (topology all).

asap's groups never wait for one another, so a group can come and go without anyone else noticing.
afd's daemons aggregate every instance's micro-batch of a step, so there the membership changes at a
step boundary: the engine stops issuing, and once nothing is in flight every daemon is told which
instances it serves from the next step (``ServeInstances``) and answers before the next step goes out
(``engine._instances_served``). Otherwise the same:

- *up*: each new group's worker is forked (``Deployment.join``: started, not a member, so that one
  that dies fails its change and not the deployment) with the placement the deployment routes by now,
  and is sent every later switch like any attention process. Once all have started they become
  members and groups of the scheduler (``scheduler/groups.py``), and take new requests from the next
  turn; the expert side attaches to their combine buffers at its first reply.
- *down*: the last groups drain at once: they admit nothing new (the new membership serves from
  here), and their resident requests are handed to the groups that stay (``drain=False``, where the
  deployment shares its KV caches: ``share_kv_cache``): between its work items the leaver's blocks
  of each are copied into blocks of a staying group with room (one copy, by the engine, out of one
  cache and into the other, both mapped from host shared memory), and it continues there; what
  finds no room, or every resident with ``drain``, finishes where it is. Once they hold nothing their workers stop,
  and every expert holder forgets their regions (asap: ``ForgetRegion``; afd: with ``ServeInstances``),
  so a group that joins at the same index later starts its buffers from scratch.

One change at a time, an expert holders' one included.
"""
from __future__ import annotations

import dataclasses
import time

from moeflow.comm.kv_pull import paired_runs, pull
from moeflow.config import ConfigError
from moeflow.engine.scale_event import ScaleEvent
from moeflow.logs import get_logger
from moeflow.messages import World
from moeflow.model.attention import attention_for
from moeflow.scheduler import groups
from moeflow.workers.kv_transfer import MappedCaches
from moeflow.workers.launch import WorkerDied, free_port

log = get_logger("moeflow.elastic")


class AttentionGroups:
    def __init__(self, engine, capacity: int, sched, floor: tuple[int, str] = (1, "")):
        """``sched``: the engine's own scheduler, whose groups follow the workers; ``floor``: the fewest
        groups, and why (dwdp: the ranks of the start hold every expert between them)."""
        self.engine, self.capacity, self.sched, self.pool = engine, capacity, sched, sched.pool
        self.floor = floor
        self.members = getattr(engine.layout, "attn_tp", 1)  # processes of one group
        self.pending: int | None = None
        self.joiners: list = []  # handles forked for the change under way, by group
        self.ready: list = []  # of which started
        self.leaving: list[int] = []  # groups draining
        self.events: list[ScaleEvent] = []
        self.drain = True  # the change under way lets the leavers' residents finish there
        self._tried = False  # every leaver's residents were offered to the others once, all leavers idle
        self._caches = MappedCaches()  # the groups' shared KV caches, mapped for a handover

    @property
    def busy(self) -> bool:
        return self.pending is not None or (bool(self.events) and self.events[-1].outcome == "running")

    @property
    def at_boundary(self) -> bool:
        """Whether the change waits for a step with nothing in flight (joiners started, or leavers
        settled): a mode with steps (afd) issues none meanwhile."""
        return bool(self.joiners and len(self.ready) == len(self.joiners)) or self._settled() or bool(
            self.leaving and not self.drain and not self._tried)

    def _settled(self) -> bool:
        """Whether every leaver holds nothing any more."""
        return bool(self.leaving) and all(groups.settled(self.pool, g) and g not in self.engine._inflight
                                          for g in self.leaving)

    def ask(self, target: int, current: int, other_busy: bool, drain: bool | None = None) -> None:
        """``drain``: a leaver's residents finish where they are (False: they are handed over, which
        needs the KV caches shared; None: handed over where they are shared)."""
        if self.busy or other_busy:
            raise ConfigError("scale attention: a change is under way; ask again once GET /scale says it is done")
        low, why = self.floor
        if target < low:
            raise ConfigError(f"scale attention: {target} is fewer than {low}: {why}")
        if not 1 <= target <= self.capacity:
            raise ConfigError(f"scale attention: {target} is outside [1, {self.capacity}] (the deployment was "
                              f"started for at most {self.capacity}: {self.engine.layout.attention_max})")
        shared = self.engine._kv_regions(0) is not None
        drain = not shared if drain is None else drain
        if not drain and not shared:
            raise ConfigError("scale attention: handing a leaving group's requests over copies their KV between "
                              "caches the engine maps (share_kv_cache, --share-kv-cache); without, give drain")
        if target != current:
            self.pending, self.drain, self._tried = target, drain, False

    def turn(self) -> None:
        """One step of the change under way (the engine calls it every turn)."""
        if self.pending is not None:
            self._begin()
        if self.joiners:
            self._poll_joiners()
        if self.leaving and not self.drain:
            self._hand_over()
        if self.leaving:
            self._retire()

    def _lists(self) -> list[list]:
        """The engine's attention workers, and the placement's (often the same list)."""
        e = self.engine
        return [e.attention] + ([e.eplb.attention_workers] if e.eplb.attention_workers is not e.attention else [])

    # -- the phases ------------------------------------------------------------------------------

    def _begin(self) -> None:
        e, n, cur = self.engine, self.pending, len(self.pool.groups)
        self.pending = None
        self.events.append(ScaleEvent("attention", cur, n, time.monotonic()))
        log.info("scale attention %d -> %d", cur, n)
        if n < cur:
            self.leaving = list(range(n, cur))
            for g in self.leaving:
                groups.drain(self.sched, g)
            self.events[-1].switched_s = time.monotonic()  # new requests go to the others from now
            return
        t = self.members
        for g in range(cur, n):
            # NOTE: a group of several (asap attn_tp) meets in a torch.distributed world of its own: its
            # collectives are its members' only, and the deployment's world was formed without it
            world = World(t, free_port(), (tuple(range(t)),)) if t > 1 else None
            for member in range(t):
                self.joiners.append(e.deployment.join(e._attention_joiner(g, member, world)))

    def _poll_joiners(self) -> None:
        e = self.engine
        try:
            for w in self.joiners:
                if not any(x is w for x in self.ready) and e.deployment.is_ready(w):
                    self.ready.append(w)
        except (WorkerDied, EOFError, OSError) as x:
            self._fail(str(x).splitlines()[0])
            return
        count = len(self.pool.groups) + len(self.joiners) // self.members
        if len(self.ready) < len(self.joiners) or not e._instances_served(count):
            return
        pool = self.pool
        for k, w in enumerate(self.joiners):
            e.deployment.admit(w)
            e._attention_admitted(w)
            for members in self._lists():
                members.append(w)
            if k % self.members == 0:
                groups.add_group(self.sched, e.config.num_kv_blocks, e.config.kv_block_size)
                e._known.append(set())
                e._freed.append([])
        e.layout = dataclasses.replace(e.layout, **{e.layout.attention_count: len(pool.groups)})
        self.joiners, self.ready = [], []
        ev = self.events[-1]
        ev.switched_s = ev.left_s = time.monotonic()
        ev.outcome = "done"
        log.info("scale attention %d -> %d done in %.2f s", ev.before, ev.after, ev.seconds)

    def _fail(self, why: str) -> None:
        e = self.engine
        for w in self.joiners:
            e.deployment.leave(w, 0.0)
        self.joiners, self.ready = [], []
        self.events[-1].outcome = f"failed: {why}"
        log.warning("scale attention: %s", self.events[-1].outcome)

    def _hand_over(self) -> None:
        """Each idle leaver's residents to the least loaded staying group with room, KV copied."""
        e, pool = self.engine, self.pool
        staying = [g for g in range(len(pool.groups)) if g not in self.leaving]
        idle = [g for g in self.leaving if g not in e._inflight and not pool.groups[g].busy and e._idle_group(g)]
        self._tried = self._tried or len(idle) == len(self.leaving)  # what found no room then finishes there
        for g in idle:
            for r in [r for r in pool.groups[g].requests if r.request_id not in pool.in_flight]:
                for h in sorted(staying, key=lambda h: len(pool.groups[h].requests)):
                    moved = groups.hand_over(self.sched, r, h)
                    if moved is not None:
                        break
                else:
                    continue  # no room anywhere: it finishes here
                old, new, n = moved
                src, dst = e._kv_regions(g), e._kv_regions(h)
                runs = paired_runs(old, src[0].block_size, new, dst[0].block_size, n)
                whole = dict(attention_for(e.model_config).kv_layout())  # every head: members hold slices
                for d in dst:  # each TP member's heads out of whichever source member holds them
                    pull([(self._caches.entries(x), x.member) for x in src], whole, self._caches.entries(d),
                         d.member, runs)
                groups.release_blocks(self.sched, g, r.request_id)
                e._known[g].discard(r.request_id)  # its state on the leaver goes with the leaver
                self.events[-1].handed += 1

    def _retire(self) -> None:
        e = self.engine
        pool = self.pool
        if not self._settled() or not e._instances_served(self.leaving[0]):
            return
        gone = e.attention[self.leaving[0] * self.members:]
        groups.remove_last(pool, len(self.leaving))
        for members in self._lists():
            for w in gone:
                members.remove(w)
        del e._known[self.leaving[0]:], e._freed[self.leaving[0]:]
        for w in gone:
            e.deployment.leave(w)
        e._regions_left(self.leaving)
        e.layout = dataclasses.replace(e.layout, **{e.layout.attention_count: len(pool.groups)})
        self.leaving = []
        self._caches.close()
        ev = self.events[-1]
        ev.left_s, ev.outcome = time.monotonic(), "done"
        log.info("scale attention %d -> %d done in %.2f s (drained)", ev.before, ev.after, ev.left_s - ev.requested_s)
