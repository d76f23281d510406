"""Processes that share fewer cores than they are: a compute stage waits until a core is free.

Where a deployment runs more worker processes than the machine has cores (four processes on this
machine's two), a process that is ready to compute often has no core: its peer holds it. The
simulator prices each stage when it starts, so the cores are a calendar rather than a processor
sharing model: each core keeps the intervals reserved on it, and a stage ready at ``t`` takes the
earliest gap of its length on any core at or after ``t`` (a short stage may run in a gap before a
longer one that was reserved earlier for later). Whole stages, not time slices: two equal stages
end at w and 2w, where the operating system's time sharing would end both at 2w; a barrier that
waits for both sees 2w either way, and the total work is conserved.

Where a system prices a stretch of stages at once, the calendar favours whoever booked first: dwdp
prices a rank's whole batch when it starts, so with more ranks than cores a later rank waits for an
earlier one's batch instead of sharing the core with it (means are then low, a rank's throughput
the same). The copy and communication threads book nothing (their CPU work is small against the
stages here: the copy thread measured 1% of a dwdp rank).

Only the profiled cost knows the machine's cores (the profile's provenance): device presets give
every process its own device, and there is nothing to share.
"""
from __future__ import annotations

import bisect


class CorePool:
    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"a core pool needs >= 1 core, got {cores}")
        self._busy: list[list[tuple[float, float]]] = [[] for _ in range(cores)]  # sorted (start, end)

    @property
    def cores(self) -> int:
        return len(self._busy)

    def reserve(self, ready_s: float, dur_s: float, now_s: float) -> float:
        """Reserve ``dur_s`` of one core at the earliest time >= ``ready_s`` it is free for that
        long; returns the start. ``now_s``: the simulated present (intervals that ended before it
        can hold nothing more, and are dropped)."""
        if dur_s <= 0:
            return ready_s
        best, best_core = None, 0
        for c, busy in enumerate(self._busy):
            while busy and busy[0][1] <= now_s:
                busy.pop(0)
            start = self._fit(busy, ready_s, dur_s)
            if best is None or start < best:
                best, best_core = start, c
        bisect.insort(self._busy[best_core], (best, best + dur_s))
        return best

    @staticmethod
    def _fit(busy: list[tuple[float, float]], ready_s: float, dur_s: float) -> float:
        t = ready_s
        for s, e in busy:
            if e <= t:
                continue
            if s >= t + dur_s:
                break
            t = e
        return t
