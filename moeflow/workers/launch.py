"""Start, watch and stop a deployment's worker processes.

Workers are forked by multiprocessing's fork server, which imported torch and the worker code
once (``fork_server.py``); each gets the engine's environment as it is at its start. Guarantees: a
worker dies with its parent (PR_SET_PDEATHSIG: the fork server, which exits with the engine
process), ignores Ctrl-C and hang-ups sent to its process group (the engine owns the shutdown; so
does the fork server), reports its own exceptions as ``WorkerFailed``; ``Deployment.shutdown``
leaves no process and no /dev/shm segment behind, whatever state the workers are in, and runs at
interpreter exit (also after SIGTERM/SIGHUP, ``moeflow.lifecycle``) if nobody called it. A
deployment starts by unlinking the segments of dead ones (``reclaim_stale``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import wait

from moeflow import lifecycle
from moeflow.comm import cleanup, mailbox_bytes
from moeflow.comm.segment import SHM_DIR, reclaim_stale
from moeflow.comm.space import check_room
from moeflow.config import ClusterConfig
from moeflow.logs import get_logger
from moeflow.messages import Shutdown, WorkerFailed, WorkerReady, WorkerSetup
from moeflow.workers import fork_start
from moeflow.workers.entry import worker_main
from moeflow.workers.interface import choose
from moeflow.workers.remote import RemoteNode
from moeflow.workers.stdio import Stdio
from moeflow.workers.worker_handle import WorkerDied, WorkerHandle

log = get_logger("moeflow.workers.launch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_workers(workers: list[WorkerHandle], timeout_s: float) -> None:
    """Ask each worker to shut down (0 s: do not ask), wait up to ``timeout_s``, kill the rest."""
    if timeout_s > 0:
        for w in workers:
            try:
                w.conn.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + timeout_s
    for w in workers:
        w.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=2.0)


def spawn(setup: WorkerSetup) -> WorkerHandle:
    """Start one worker process on this host (forked by the fork server, started with the first)."""
    ctx = fork_start.context()
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=worker_main, args=(setup, theirs, dict(os.environ), Stdio()),
                    name=f"moeflow-{setup.role}{setup.index}", daemon=True)
    p.start()
    theirs.close()
    return WorkerHandle(setup.role, setup.index, p, ours)


class Deployment:
    """Every worker of one deployment: spawned here (node 0's), or by their node (``remote.py``),
    whose handles behave the same."""

    def __init__(self, setups: list[WorkerSetup], deployment_id: str, ready_timeout_s: float = 300.0,
                 cluster: ClusterConfig | None = None, published_shm_bytes: int = 0):
        """``published_shm_bytes``: what this host's workers publish in /dev/shm besides their
        mailboxes (dwdp's resident experts); with the mailboxes it must fit before anything starts."""
        self.deployment_id, self.setups = deployment_id, list(setups)
        self.workers: list[WorkerHandle] = []
        self.joining: list[tuple[WorkerHandle, WorkerSetup]] = []  # started while serving, not yet members
        self.nodes: list[RemoteNode] = []  # the other hosts' workers, one entry per host
        freed = reclaim_stale()
        if freed:
            log.warning("reclaimed %.1f MiB of shared memory left by dead deployments %s",
                        sum(freed.values()) / 2**20, sorted(freed))
        needed = sum(mailbox_bytes(c) for c in {id(s.comm): s.comm for s in setups}.values()) + published_shm_bytes
        if needed:
            check_room(SHM_DIR, needed, f"deployment {deployment_id} ({len(setups)} workers)")
        lifecycle.handle_signals()
        lifecycle.release_at_exit(self)
        try:
            remote = sorted({s.node for s in setups} - {0})
            if remote and (cluster is None or cluster.nnodes <= max(remote)):
                raise ValueError(f"setups name nodes {remote}, but the cluster is {cluster}")
            if remote:  # before anything starts: a host the others cannot reach fails now, saying why
                iface = choose(cluster.master_addr)
                log.info("gloo between hosts on %s (%s, chosen by %s)", iface.name, iface.addr, iface.chosen_by)
            for node in remote:  # first: their setups travel while ours start
                mine = [s for s in setups if s.node == node]
                self.nodes.append(RemoteNode(cluster, node, deployment_id, mine))
            by_setup = {id(p.setup): WorkerHandle(p.setup.role, p.setup.index, p, c)
                        for n in self.nodes for c, p in n.handles}
            for s in setups:  # in the caller's order, whichever host runs them
                self.workers.append(by_setup[id(s)] if s.node else spawn(s))
            self._wait_ready(ready_timeout_s if not remote else max(ready_timeout_s, cluster.connect_timeout_s))
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
                w.memory, w.kv_region = msg.memory, msg.kv_region
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
        why = getattr(w.process, "reason", None) or f"exit code {w.process.exitcode}"  # a RemoteProcess knows more
        raise WorkerDied(f"{w.name} exited unexpectedly ({why})", w)

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

    def respawn(self, index: int) -> WorkerHandle:
        """Start worker ``index`` (a dead one, on this host) again from its setup; it takes the old
        one's place in ``workers`` and is ready once ``is_ready`` says so."""
        setup = self.setups[index]
        if setup.node != 0 or setup.world is not None:
            raise ValueError(f"{self.workers[index].name} is in a torch.distributed world or on another host: "
                             f"it can only come back with the whole deployment")
        old = self.workers[index]
        old.process.join(timeout=1.0)
        stop_workers([old], 0.0)  # one that has not exited by now would keep its process object open
        old.close()
        self.workers[index] = spawn(setup)
        return self.workers[index]

    def is_ready(self, w: WorkerHandle) -> bool:
        """Whether a (re)started worker has reported ready; raises WorkerDied if it failed instead."""
        if not w.conn.poll(0) and w.process.is_alive():
            return False
        msg = self._recv(w)
        if not isinstance(msg, WorkerReady):
            raise WorkerDied(f"{w.name} sent {type(msg).__name__} while starting", w)
        w.memory, w.kv_region = msg.memory, msg.kv_region
        return True

    # -- membership while serving (elastic deployments) ------------------------------------------

    def join(self, setup: WorkerSetup) -> WorkerHandle:
        """Start a worker that was not in the deployment, on this host or by its node (``setup.node``).
        It is joining (watched by whoever started it, not by ``recv_any``: its death fails its join,
        not the deployment) until ``admit`` makes it a member; ``is_ready`` says when it has started.
        Its world, if any, is its own group's (the deployment's was formed without it)."""
        if setup.node == 0:
            w = spawn(setup)
        else:
            nodes = {n.node: n for n in self.nodes}
            if setup.node not in nodes:
                raise ValueError(f"{setup.role} {setup.index}: node {setup.node} runs none of this deployment's "
                                 f"workers (nodes {sorted(nodes)}): a member joins a node that runs some")
            conn, process = nodes[setup.node].add(setup)
            w = WorkerHandle(setup.role, setup.index, process, conn)
        self.joining.append((w, setup))
        return w

    def admit(self, w: WorkerHandle) -> None:
        (i,) = [i for i, (x, _) in enumerate(self.joining) if x is w]
        self.setups.append(self.joining.pop(i)[1])
        self.workers.append(w)

    def leave(self, w: WorkerHandle, timeout_s: float = 5.0) -> None:
        """Stop a member, or a joining worker, and forget it: asked to shut down, killed after
        ``timeout_s``. It unlinks its own segments; a killed one's go with the next owner of their
        names, or with the deployment."""
        joining = [i for i, (x, _) in enumerate(self.joining) if x is w]
        if joining:
            del self.joining[joining[0]]
        else:
            (i,) = [i for i, x in enumerate(self.workers) if x is w]
            del self.workers[i], self.setups[i]
        stop_workers([w], timeout_s)
        w.close()

    def send(self, w: WorkerHandle, msg) -> None:
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError):
            w.process.join(1.0)
            raise WorkerDied(f"{w.name} is gone (control pipe closed; exit code {w.process.exitcode})", w) from None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with lifecycle.shielded():  # a signal meanwhile would leave processes or segments behind
            everyone = self.workers + [w for w, _ in self.joining]
            stop_workers(everyone, timeout_s)
            for w in everyone:
                w.close()
            self.joining.clear()
            for n in self.nodes:
                n.close()
            cleanup(self.deployment_id)  # segments of workers that could not unlink their own
            lifecycle.forget(self)


def describe_nodes(setups: list[WorkerSetup], nnodes: int) -> str:
    """Which workers each host runs, as the start-up line prints it."""
    parts = []
    for node in range(nnodes):
        mine = [f"{s.role} {s.index}" for s in setups if s.node == node]
        parts.append(f"node {node}: {', '.join(mine) or 'nothing'}{' + engine' if node == 0 else ''}")
    return "; ".join(parts)
