"""Start, watch and stop a deployment's worker processes.

Guarantees: a worker dies with its parent (PR_SET_PDEATHSIG), ignores Ctrl-C and hang-ups sent to
its process group (the engine owns the shutdown), reports its own exceptions as ``WorkerFailed``;
``Deployment.shutdown`` leaves no process and no /dev/shm segment behind, whatever state the
workers are in, and runs at interpreter exit (also after SIGTERM/SIGHUP, ``moeflow.lifecycle``) if
nobody called it. A deployment starts by unlinking the segments of dead ones (``reclaim_stale``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from moeflow import lifecycle
from moeflow.comm import cleanup
from moeflow.comm.segment import reclaim_stale
from moeflow.logs import get_logger
from moeflow.messages import Shutdown, WorkerFailed, WorkerReady, WorkerSetup

log = get_logger("moeflow.workers.launch")


class WorkerDied(RuntimeError):
    """A worker process exited or raised; the message names it and carries its traceback."""

    def __init__(self, message: str, worker: "WorkerHandle | None" = None):
        super().__init__(message)
        self.worker = worker  # which one (None: not known)


def worker_main(setup: WorkerSetup, conn: Connection) -> None:
    """Entry point of every worker process."""
    lifecycle.die_with_parent()
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if setup.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {setup.cpu})
    import torch

    torch.set_num_threads(setup.engine.num_threads)
    from moeflow.comm import make_transport
    from moeflow.workers.roles import build_worker
    from moeflow.workers.world import close_world, init_world

    worker = None
    try:
        tp = init_world(setup)
        worker = build_worker(setup, make_transport(setup.comm), tp)
        conn.send(WorkerReady(setup.role, setup.index, os.getpid(), worker.memory()))
        worker.serve(conn)
    except BaseException:
        try:
            conn.send(WorkerFailed(setup.role, setup.index, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if worker is not None:
            worker.close()
        close_world()


@dataclass
class WorkerHandle:
    role: str
    index: int
    process: mp.process.BaseProcess
    conn: Connection  # engine end of the control pipe
    memory: dict = field(default_factory=dict)  # what it reported holding at start, bytes by kind

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.index} (pid {self.process.pid})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    def __init__(self, setups: list[WorkerSetup], deployment_id: str, ready_timeout_s: float = 300.0):
        self.deployment_id = deployment_id
        self.workers: list[WorkerHandle] = []
        freed = reclaim_stale()
        if freed:
            log.warning("reclaimed %.1f MiB of shared memory left by dead deployments %s",
                        sum(freed.values()) / 2**20, sorted(freed))
        lifecycle.handle_signals()
        lifecycle.release_at_exit(self)
        ctx = mp.get_context("spawn")
        try:
            for s in setups:
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(s, theirs), name=f"moeflow-{s.role}{s.index}",
                                daemon=True)
                p.start()
                theirs.close()
                self.workers.append(WorkerHandle(s.role, s.index, p, ours))
            self._wait_ready(ready_timeout_s)
            log.debug("deployment %s: %d workers ready", deployment_id, len(self.workers))
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        pending = {w.conn: w for w in self.workers}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDied(f"workers not ready after {timeout_s:.0f} s: {[w.name for w in pending.values()]}")
            sentinels = {w.process.sentinel: w for w in pending.values()}
            for ready in wait(list(pending) + list(sentinels), timeout=left):
                w = pending.get(ready) or sentinels[ready]
                msg = self._recv(w)
                if not isinstance(msg, WorkerReady):
                    raise WorkerDied(f"{w.name} sent {type(msg).__name__} while starting")
                w.memory = msg.memory
                pending.pop(w.conn, None)

    def _recv(self, w: WorkerHandle):
        """The next message of a worker; raises WorkerDied with its traceback if it failed or died."""
        try:
            if w.conn.poll(0.5):
                msg = w.conn.recv()
                if isinstance(msg, WorkerFailed):
                    raise WorkerDied(f"{w.name} failed:\n{msg.error}", w)
                return msg
        except (EOFError, OSError):
            pass
        w.process.join(timeout=0.5)
        raise WorkerDied(f"{w.name} exited unexpectedly (exit code {w.process.exitcode})", w)

    def recv_any(self, conns: list[WorkerHandle], timeout_s: float,
                 watch: list[WorkerHandle] | None = None) -> list[tuple[WorkerHandle, object]]:
        """Messages from the given workers within ``timeout_s``; the death of any worker in ``watch``
        (default: all of them) raises WorkerDied."""
        by_conn = {w.conn: w for w in conns}
        by_sentinel = {w.process.sentinel: w for w in (self.workers if watch is None else watch)}
        out = []
        for ready in wait(list(by_conn) + list(by_sentinel), timeout=timeout_s):
            w = by_conn.get(ready) or by_sentinel[ready]
            out.append((w, self._recv(w)))
        return out

    def send(self, w: WorkerHandle, msg) -> None:
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError):
            raise WorkerDied(f"{w.name} is gone (control pipe closed)", w) from None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with lifecycle.shielded():  # a signal meanwhile would leave processes or segments behind
            for w in self.workers:
                try:
                    w.conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
            deadline = time.monotonic() + timeout_s
            for w in self.workers:
                w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            for w in self.workers:
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(timeout=2.0)
                w.conn.close()
            cleanup(self.deployment_id)  # segments of workers that could not unlink their own
            lifecycle.forget(self)
