"""The event loop: a time-ordered heap of callbacks on a virtual clock (no wall clock anywhere).

Events at the same time run in the order they were scheduled, so a run is a pure function of its
inputs.

An event that would be the next one popped anyway may run in place instead (``take``): a handler
whose last act would be ``at(t, ...)`` asks ``take(t)`` and, when granted, goes on with that event's
work itself. The heap would pop it next exactly when nothing queued is due at or before ``t``
(queued ones were scheduled earlier, so they win ties), so the order, the clock, the event count and
the stop checks are those of the heap; a chain of such events costs no heap operations.
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
        self._stop: Callable[[], bool] | None = None
        self._every = 1  # the stop check runs after every event whose count is a multiple of this
        self._unchecked = False  # the running event's stop check is still due (it runs once the event's work is done)
        self.halted = False  # ``stop`` turned true: nothing runs any more

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

    def take(self, time_s: float) -> bool:
        """The next event at ``time_s``, run in place: True when it is the next one anyway (the
        clock is then at ``time_s``, the event counted, and the caller does its work); False when
        something queued comes first or the run has stopped (the caller schedules it with ``at``).

        NOTE: only as a handler's last act: the running event's stop check happens here, so its
        work must be done."""
        if self._unchecked:
            self._unchecked = False
            self.halted = self.num_events % self._every == 0 and self._stop is not None and self._stop()
        heap = self._heap
        if self.halted or (heap and heap[0][0] <= time_s) or time_s < self.now:
            return False
        self.now = time_s
        self.num_events += 1
        self._unchecked = True
        return True

    def run(self, stop: Callable[[], bool] | None = None, every: int = 1) -> None:
        """Process events in time order until none is left or ``stop()``, asked after every
        ``every``-th event, turns true."""
        heap, pop = self._heap, heapq.heappop
        self._stop, self._every = stop, every
        while self._hard:
            t, _, fn, args, timer = pop(heap)
            if not timer:
                self._hard -= 1
            self.now = t
            self.num_events += 1
            self._unchecked = True
            fn(*args)
            if self._unchecked:
                self._unchecked = False
                self.halted = self.num_events % every == 0 and stop is not None and stop()
            if self.halted:
                return
