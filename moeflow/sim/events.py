"""The event loop: a time-ordered heap of callbacks on a virtual clock (no wall clock anywhere).

Events at the same time run in the order they were scheduled, so a run is a pure function of its
inputs.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.num_events = 0
        self._heap: list[tuple[float, int, Callable, tuple, bool]] = []  # (time, order, fn, args, timer)
        self._hard = 0  # events in the heap that are not timers
        self._seq = itertools.count()

    def at(self, time_s: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` at ``time_s`` (never in the past)."""
        if time_s < self.now:
            raise ValueError(f"event scheduled at {time_s} s, before now ({self.now} s)")
        self._hard += 1
        heapq.heappush(self._heap, (time_s, next(self._seq), fn, args, False))

    def timer(self, time_s: float, fn: Callable, *args) -> None:
        """Like ``at``, but a timer alone does not keep the run going: once only timers are left the
        run ends (a lease's deadline must not stretch the run to it when nothing waits on it)."""
        if time_s < self.now:
            raise ValueError(f"timer set at {time_s} s, before now ({self.now} s)")
        heapq.heappush(self._heap, (time_s, next(self._seq), fn, args, True))

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Process events in time order until none is left or ``stop()`` turns true."""
        heap, pop = self._heap, heapq.heappop
        while self._hard:
            t, _, fn, args, timer = pop(heap)
            if not timer:
                self._hard -= 1
            self.now = t
            self.num_events += 1
            fn(*args)
            if stop():
                return
