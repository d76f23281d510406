"""An asap deployment's MoE workers as the simulator prices a layer's dispatch through them.

Each worker has a receive port, a compute stream and a send port, all FIFO (with ``overlap``;
without it one stream receives, computes and sends in turn). A dispatch sent at ``sent_s`` is
priced through every worker at once, since the recurrences of different workers are independent:
``price`` is the fast path, ``price_one_by_one`` its oracle (and the only path with shared cores or
a trace). Each returns when the last combine has left its worker, plus the link latency.

When every port and stream is free by the dispatch (``free_by``), each max of the recurrence takes
the dispatch's side and the result is the sums alone, in the same order: ``price_free`` returns it
and leaves the ports' new times to be written when something next reads them, so a lone batch's
layers write them once.
"""
from __future__ import annotations

from collections.abc import Callable


class MoeWorkers:
    def __init__(self, num_workers: int, overlap: bool, latency_s: float):
        self.overlap, self.latency = overlap, latency_s
        self.in_free = [0.0] * num_workers  # receive port (with overlap)
        self.free = [0.0] * num_workers  # compute stream (without overlap: the one stream)
        self.out_free = [0.0] * num_workers  # send port (with overlap)
        self.busy_until = 0.0  # the latest of all those times
        self._unwritten: tuple | None = None  # price_free's (sent_s, in_add, times, out_add)

    def free_by(self, sent_s: float) -> bool:
        return sent_s >= self.busy_until

    def price_free(self, in_add: list[float], times: list[float], out_add: list[float], sent_s: float) -> float:
        """``price`` when ``free_by(sent_s)``."""
        lat = self.latency
        if self.overlap:
            most = max([((sent_s + a + lat) + x) + b for a, x, b in zip(in_add, times, out_add)])
        else:
            ready = sent_s + lat
            most = max([((ready + a) + x) + b for a, x, b in zip(in_add, times, out_add)])
        self._unwritten = sent_s, in_add, times, out_add
        self.busy_until = most
        return most + lat

    def _write(self) -> None:
        sent_s, in_add, times, out_add = self._unwritten
        self._unwritten = None
        lat, in_free, free, out_free = self.latency, self.in_free, self.free, self.out_free
        for w, (a, x, b) in enumerate(zip(in_add, times, out_add)):
            if self.overlap:
                in_free[w] = r = sent_s + a
                free[w] = c = (r + lat) + x
                out_free[w] = c + b
            else:
                free[w] = (((sent_s + lat) + a) + x) + b

    def price(self, in_add: list[float], times: list[float], out_add: list[float], sent_s: float) -> float:
        """The fast path: each pair's seconds on the links taken once per batch (``in_add``,
        ``out_add``: pairs x seconds per pair), the recurrences on floats."""
        if self._unwritten is not None:
            self._write()
        lat, in_free, free, out_free = self.latency, self.in_free, self.free, self.out_free
        most = 0.0
        if self.overlap:
            for w, (a, x, b) in enumerate(zip(in_add, times, out_add)):
                r = in_free[w]
                r = (r if r >= sent_s else sent_s) + a
                in_free[w] = r
                r += lat
                c = free[w]
                c = (r if r >= c else c) + x
                free[w] = c
                o = out_free[w]
                o = (c if c >= o else o) + b
                out_free[w] = o
                if o > most:
                    most = o
        else:
            ready = sent_s + lat
            for w, (a, x, b) in enumerate(zip(in_add, times, out_add)):
                o = free[w]
                o = (o if o >= ready else ready) + a + x + b
                free[w] = o
                if o > most:
                    most = o
        self.busy_until = most  # NOTE: every worker's times only grow, so the new maximum is this
        return most + lat

    def price_one_by_one(self, pairs: list[float], times: list[float], sent_s: float, in_s: float, out_s: float,
                         reserve: Callable[[float, float], float] | None,
                         span: Callable[[int, float, float], None]) -> float:
        """The oracle: worker after worker with each pair's seconds on the links, a compute waiting
        for a free core (``reserve(ready_s, seconds)`` -> start; None: a core of its own), and
        ``span(worker, start, end)`` of each one's experts."""
        if self._unwritten is not None:
            self._write()
        lat, in_free, free, out_free = self.latency, self.in_free, self.free, self.out_free
        back = 0.0
        for w in range(len(free)):
            if self.overlap:
                recv_end = max(sent_s, in_free[w]) + pairs[w] * in_s
                in_free[w] = recv_end
                start = max(recv_end + lat, free[w])
                if reserve is not None:
                    start = reserve(start, times[w])
                end = start + times[w]
                free[w] = end
                send_end = max(end, out_free[w]) + pairs[w] * out_s
                out_free[w] = send_end
            else:  # one stream: receive, compute and send one after another, all on the worker's core
                start = max(sent_s + lat, free[w])
                if reserve is not None:
                    start = reserve(start, pairs[w] * (in_s + out_s) + times[w])
                end = start + pairs[w] * in_s + times[w]
                send_end = end + pairs[w] * out_s
                free[w] = send_end
            span(w, start, end)
            back = max(back, send_end + lat)
            self.busy_until = max(self.busy_until, send_end)
        return back
