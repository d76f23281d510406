"""A system whose scheduler runs global steps (dep, afd): the step loop ``System``'s subclasses share."""
from __future__ import annotations

import abc

from moeflow.core import Request
from moeflow.sim.system import System


class StepSystem(System):
    """A system whose scheduler runs global steps (dep, afd): one step at a time, the next as soon
    as the last one ends, idle while the scheduler has nothing."""

    lands_handed_kv = True
    busy = False
    stop_check_every = 256  # an event here is a whole step of the deployment, not one layer's
    # a list: every step's (start time, work items, busy_s and split_s before it) is appended (sim/decode.py)
    step_log: list | None = None
    split_s: dict[str, float] = {}  # summed over entities: step time by kind, where a system keeps it

    def add(self, request: Request) -> None:
        if self.spec.sim.decode_side:  # its prompt's KV and first token arrive with it (pd's decode side)
            request.output_token_ids.append(0)
            t = self.track[request.request_id]
            t.first_scheduled_s = t.first_token_s = self.loop.now
            self.handed.append(request)
        else:
            self.sched.add(request)
        self.poke()

    def poke(self) -> None:
        if not self.busy:
            self._step()

    def _admit_handed(self) -> None:
        """First come first served: each waiting request that a group has room for lands there."""
        port = self.handoff_port()
        while self.handed:
            gid = port.room(self.handed[0])
            if gid is None:
                return
            r = self.handed.popleft()
            port.reserve(gid, r)
            port.arrive(r)

    def _step(self) -> None:
        if self.spec.sim.decode_side:
            self._admit_handed()
        works = self.sched.schedule(self.loop.now)
        self.busy = bool(works)
        if works:
            if self.step_log is not None:
                self.step_log.append((self.loop.now, works, {**self.busy_s, **self.split_s}))
            self.run_step(works, self.loop.now)

    @abc.abstractmethod
    def run_step(self, works: list, now: float) -> None:
        """Time one step's work items and schedule its end (which calls ``_step`` again)."""
