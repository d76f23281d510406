"""The processes ``moeflow plan`` simulates in: spawned workers, each receive → simulate → reply.

Not ``multiprocessing.Pool``: its ``join`` waits for every queued job (SIGTERM unwound into it while
the workers kept computing), a worker that dies takes its job with it and the pool waits forever,
and the search once hung in ``join`` with both workers idle. Here the parent hands each worker one
job at a time (``submit``; the search may give an idle one a job ahead of its turn), waits on the
workers' pipes and process sentinels together (``next_done``), and whichever way it leaves (the
last reply, a worker's exception or death, SIGTERM, Ctrl-C) it kills what still runs: a worker
holds nothing but a simulation's state.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait

from moeflow import lifecycle

_JOIN_S = 2.0  # a worker told to leave has this long before it is killed


class SimulationFailed(RuntimeError):
    """A simulation raised or its worker died; the message names the job."""


def _serve(conn, fn: Callable) -> None:
    lifecycle.die_with_parent()
    # NOTE: Ctrl-C reaches the whole process group; the parent alone decides, and kills its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        try:
            reply = (True, fn(job))
        except Exception:
            reply = (False, traceback.format_exc())
        conn.send(reply)


class Workers:
    """``num_workers`` spawned processes running ``fn`` on one job at a time; a context manager
    that kills them on the way out."""

    def __init__(self, fn: Callable, num_workers: int):
        self.fn, self.procs, self.conns = fn, [None] * num_workers, [None] * num_workers
        self._running: dict[int, object] = {}  # worker -> the job it computes
        try:
            for w in range(num_workers):
                self._start(w)
        except BaseException:
            self.kill()
            raise

    def _start(self, w: int) -> None:
        ctx = mp.get_context("spawn")  # NOTE: not fork: the parent may hold torch's threads
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(child, self.fn), daemon=True)
        p.start()
        child.close()
        self.procs[w], self.conns[w] = p, parent

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.kill()

    @property
    def num_idle(self) -> int:
        return len(self.procs) - len(self._running)

    def running(self) -> list:
        return list(self._running.values())

    def submit(self, job) -> None:
        """``job`` to an idle worker (``num_idle`` > 0)."""
        w = next(w for w in range(len(self.procs)) if w not in self._running)
        self.conns[w].send(job)
        self._running[w] = job

    def cancel(self, job) -> None:
        """The worker computing ``job`` killed and replaced by a fresh one."""
        w = next(w for w, j in self._running.items() if j is job)
        del self._running[w]
        self.procs[w].kill()
        self.procs[w].join(_JOIN_S)
        self.conns[w].close()
        self._start(w)

    def next_done(self, name: Callable[[object], str]) -> tuple[object, object]:
        """(job, ``fn(job)``) of the next job to end; one that raised, or whose worker died,
        raises ``SimulationFailed`` naming it (``name(job)``)."""
        while True:
            ready = set(wait([self.conns[w] for w in self._running] + [self.procs[w].sentinel for w in self._running]))
            for w in list(self._running):
                conn, p = self.conns[w], self.procs[w]
                if conn in ready:
                    try:
                        ok, value = conn.recv()
                    except EOFError:  # died mid-reply: its sentinel says how
                        p.join(_JOIN_S)
                        raise SimulationFailed(f"the worker simulating {name(self._running[w])} died "
                                               f"(exit code {p.exitcode})") from None
                    if not ok:
                        raise SimulationFailed(f"simulating {name(self._running[w])} failed in its worker:\n{value}")
                    return self._running.pop(w), value
                if p.sentinel in ready:
                    p.join(_JOIN_S)
                    raise SimulationFailed(f"the worker simulating {name(self._running[w])} died (exit code {p.exitcode})")

    def imap_unordered(self, jobs: list, name: Callable[[object], str]) -> Iterator:
        """``fn(job)`` of every job, in the order they end (``next_done``)."""
        todo = list(reversed(jobs))
        while todo or self._running:
            while todo and self.num_idle:
                self.submit(todo.pop())
            yield self.next_done(name)[1]

    def close(self) -> None:
        """Every idle worker told to leave (killed if it has not within ``_JOIN_S``); a busy one
        killed at once: what it computes was not asked for any more."""
        for w, conn in enumerate(self.conns):
            if w in self._running:
                continue
            try:
                conn.send(None)
            except OSError:  # already gone
                pass
        for w in self._running:
            self.procs[w].kill()
        for p in self.procs:
            p.join(_JOIN_S)
        self.kill()

    def kill(self) -> None:
        procs = [p for p in self.procs if p is not None]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(_JOIN_S)
            if p.exitcode is not None:
                p.close()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.procs, self.conns, self._running = [], [], {}
