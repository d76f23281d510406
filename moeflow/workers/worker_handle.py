"""A started worker as the engine holds it (``WorkerHandle``: its process and control pipe), and how
one fails (``WorkerDied``, ``WorkerStalled``)."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from moeflow.messages import KvRegion


class WorkerDied(RuntimeError):
    """A worker process exited or raised; the message names it and carries its traceback."""

    def __init__(self, message: str, worker: "WorkerHandle | None" = None):
        super().__init__(message)
        self.worker = worker  # which one (None: not known)


class WorkerStalled(WorkerDied):
    """Work went unanswered past the stall timeout: the deployment is handled as if a worker died."""

    def __init__(self, message: str, group: int):
        super().__init__(message)
        self.group = group  # the group whose work item went unanswered


def process_state(pid: int) -> str | None:
    """The state letter of a local process (R running, S sleeping, T stopped, D in uninterruptible
    sleep, Z zombie, ...), None when it is gone (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class ExitedProcess:
    """What a handle keeps of a local worker process once its process object is closed: who it
    was and how it ended (a closed ``multiprocessing.Process`` raises on every question)."""

    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


@dataclass
class WorkerHandle:
    role: str
    index: int
    process: mp.process.BaseProcess | ExitedProcess  # or a RemoteProcess (its node closes it)
    conn: Connection  # engine end of the control pipe
    memory: dict = field(default_factory=dict)  # what it reported holding at start, bytes by kind
    kv_region: KvRegion | None = None  # its KV cache, shared for the handoff (``EngineConfig.share_kv_cache``)

    @property
    def name(self) -> str:
        node = getattr(self.process, "node", None)  # a RemoteProcess
        where = f" on node {node.node}" if node is not None else ""
        return f"{self.role} worker {self.index} (pid {self.process.pid}{where})"

    def close(self) -> None:
        """Close the control pipe and, once the worker has exited, its process object. NOTE: a
        deployment's objects form reference cycles, so without this the process object's two
        descriptors (its fork-server sentinel and the duplicate of the pipe its setup went
        through) lived until a full garbage collection, which a server seldom runs: 4 pipes per
        restart of a two-worker deployment. One still running (it outlived its kill) keeps its
        process object. Idempotent."""
        self.conn.close()
        p = self.process
        if isinstance(p, mp.process.BaseProcess) and p.exitcode is not None:
            self.process = ExitedProcess(p.pid, p.exitcode)
            p.close()
