"""The processes ``moeflow plan`` simulates in: spawned workers, each receive → simulate → reply.

Not ``multiprocessing.Pool``: its ``join`` waits for every queued job (SIGTERM unwound into it while
the workers kept computing), a worker that dies takes its job with it and the pool waits forever,
and the search once hung in ``join`` with both workers idle. Here the parent hands each worker one
job at a time, waits on the workers' pipes and process sentinels together, and whichever way it
leaves (the last reply, a worker's exception or death, SIGTERM, Ctrl-C) it kills what still runs:
a worker holds nothing but a simulation's state.
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
        ctx = mp.get_context("spawn")  # NOTE: not fork: the parent may hold torch's threads
        self.fn, self.procs, self.conns = fn, [], []
        try:
            for _ in range(num_workers):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(child, fn), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.kill()

    def imap_unordered(self, jobs: list, name: Callable[[object], str]) -> Iterator:
        """``fn(job)`` of every job, in the order they finish; a job that raised, or whose worker
        died, raises ``SimulationFailed`` naming it (``name(job)``)."""
        todo = list(reversed(jobs))
        running: dict[int, object] = {}  # worker -> its job
        for w in range(len(self.procs)):
            if todo:
                running[w] = todo.pop()
                self.conns[w].send(running[w])
        while running:
            ready = set(wait([self.conns[w] for w in running] + [self.procs[w].sentinel for w in running]))
            for w in list(running):
                conn, p = self.conns[w], self.procs[w]
                if conn in ready:
                    try:
                        ok, value = conn.recv()
                    except EOFError:  # died mid-reply: its sentinel says how
                        p.join(_JOIN_S)
                        raise SimulationFailed(f"the worker simulating {name(running[w])} died "
                                               f"(exit code {p.exitcode})") from None
                    if not ok:
                        raise SimulationFailed(f"simulating {name(running[w])} failed in its worker:\n{value}")
                    del running[w]
                    if todo:
                        running[w] = todo.pop()
                        conn.send(running[w])
                    yield value
                elif p.sentinel in ready:
                    p.join(_JOIN_S)
                    raise SimulationFailed(f"the worker simulating {name(running[w])} died (exit code {p.exitcode})")

    def close(self) -> None:
        """Every worker told to leave, and killed if it has not within ``_JOIN_S``."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:  # already gone
                pass
        for p in self.procs:
            p.join(_JOIN_S)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(_JOIN_S)
            if p.exitcode is not None:
                p.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
