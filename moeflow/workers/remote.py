"""Node 0's side of a worker node: its workers look like local ones to ``Deployment``.

Every remote worker gets a ``WorkerHandle`` whose ``conn`` is the engine's end of a local pipe and
whose ``process`` is a ``RemoteProcess`` (pid, sentinel, is_alive, join, kill), so the engine's
waits and failure handling need no second code path. Two relay threads per node move messages
between those pipes and the rendezvous: down (pipe -> the node's inbox) and up (its outbox ->
pipe). A worker is dead when its node says so (``WorkerExited``), or when the node's heartbeat
stalls for ``heartbeat_timeout_s`` (the whole host is gone); then its pipe and sentinel close,
which every wait of the engine sees at once.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from multiprocessing.connection import wait

from moeflow.config import ClusterConfig
from moeflow.logs import get_logger
from moeflow.messages import KillWorker, StartWorkers, StopWorkers, WorkerExited, WorkerReady, WorkerSetup
from moeflow.workers.rendezvous import Channel, Heartbeat, RendezvousError, connect, node_inbox, node_outbox

log = get_logger("moeflow.workers.remote")

_POLL_S = 0.1  # how often a relay thread looks at its stop flag and the heartbeat


class RemoteProcess:
    """What ``Deployment`` asks of a worker process, for one running on another node."""

    def __init__(self, node: "RemoteNode", slot: int, setup: WorkerSetup):
        self.node, self.slot, self.setup = node, slot, setup
        self.pid: int | None = None  # the remote pid, from its WorkerReady
        self.exitcode: int | None = None
        self.reason: str | None = None  # why it is taken for dead when its node cannot say (node lost)
        self._dead = threading.Event()
        self._sentinel_r, self._sentinel_w = os.pipe()  # readable (EOF) once the worker is gone

    @property
    def sentinel(self) -> int:
        return self._sentinel_r

    def is_alive(self) -> bool:
        return not self._dead.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._dead.wait(timeout)

    def kill(self) -> None:
        """This worker only (its node goes on serving the others); dead from now for the engine."""
        self.node.kill(self.slot)
        self.mark_dead(self.exitcode)

    def mark_dead(self, exitcode: int | None) -> None:
        if not self._dead.is_set():
            self.exitcode = exitcode
            self._dead.set()
            os.close(self._sentinel_w)

    def close(self) -> None:
        """Idempotent: a deployment shut down twice (after a failure, then by its owner) closes once."""
        self.mark_dead(self.exitcode)
        if self._sentinel_r >= 0:
            os.close(self._sentinel_r)
            self._sentinel_r = -1


class RemoteNode:
    """The workers of node ``node`` for one deployment, started by posting their setups."""

    def __init__(self, cluster: ClusterConfig, node: int, deployment_id: str, setups: list[WorkerSetup]):
        self.cluster, self.node, self.deployment_id = cluster, node, deployment_id
        self._down = Channel(connect(cluster), node_inbox(node))
        self._up = Channel(connect(cluster), node_outbox(node))
        self._heartbeat = Heartbeat(self._up.store, node)
        self.handles: list[tuple[mp.connection.Connection, RemoteProcess]] = []  # (engine end, process)
        self._relay_ends = []
        for slot, s in enumerate(setups):
            ours, theirs = mp.Pipe()
            self.handles.append((ours, RemoteProcess(self, slot, s)))
            self._relay_ends.append(theirs)
        self._stopping = threading.Event()
        self._stopped = False
        self._stop_acked = threading.Event()
        self._lost = False
        self._down.put((deployment_id, None, StartWorkers(deployment_id, list(setups))))
        self._added = 0  # workers added since the start: the down relay looks for their pipes
        self._threads = [threading.Thread(target=f, daemon=True, name=f"moeflow-node{node}-{f.__name__}")
                         for f in (self._relay_down, self._relay_up)]
        for t in self._threads:
            t.start()

    def add(self, setup: WorkerSetup) -> tuple[mp.connection.Connection, RemoteProcess]:
        """Start one more worker there (it joins the running deployment): its (engine end, process)."""
        ours, theirs = mp.Pipe()
        handle = (ours, RemoteProcess(self, len(self.handles), setup))
        self.handles.append(handle)
        self._relay_ends.append(theirs)
        self._added += 1
        self._down.put((self.deployment_id, None, StartWorkers(self.deployment_id, [setup])))
        return handle

    def kill(self, slot: int) -> None:
        try:
            self._down.put((self.deployment_id, slot, KillWorker()))
        except RendezvousError:
            pass  # the node is gone, and its workers with it

    def _relay_down(self) -> None:
        """Engine -> workers: whatever the engine writes into a worker's pipe goes to the node."""
        by_conn, added = {c: slot for slot, c in enumerate(self._relay_ends)}, 0
        while not self._stopping.is_set():
            if self._added > added:  # workers that joined: their pipes too
                added = self._added
                by_conn |= {c: slot for slot, c in enumerate(list(self._relay_ends)) if c not in by_conn
                            and not c.closed}
            # NOTE: _relay_up closes the pipe of a worker that exited, at any moment: drop it, keep
            # relaying to the others (dwdp goes on without a dead rank).
            by_conn = {c: slot for c, slot in by_conn.items() if not c.closed}
            if not by_conn:  # every worker there left: joiners may come
                self._stopping.wait(_POLL_S)
                continue
            try:
                ready = wait(list(by_conn), timeout=_POLL_S)
            except (OSError, ValueError):
                continue
            for c in ready:
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    by_conn.pop(c, None)
                    continue
                try:
                    self._down.put((self.deployment_id, by_conn[c], msg))
                except RendezvousError as e:
                    self._all_dead(f"{e}")
                    return

    def _relay_up(self) -> None:
        """Workers -> engine, and the node's heartbeat."""
        c, hb = self.cluster, self._heartbeat
        while not self._stopping.is_set():
            try:
                got = self._up.get(_POLL_S)
                silent_s = hb.silent_s()
            except RuntimeError as e:
                self._all_dead(str(e))
                return
            if hb.has_beaten and silent_s > c.heartbeat_timeout_s:
                self._all_dead(f"node {self.node} sent no heartbeat for {silent_s:.1f} s")
                return
            if not hb.has_beaten and silent_s > c.connect_timeout_s:
                self._all_dead(f"node {self.node} did not connect within {c.connect_timeout_s:g} s: start "
                               f"'moeflow worker-node --node-rank {self.node} --nnodes {c.nnodes} --master-addr "
                               f"{c.master_addr} --master-port {c.master_port}' there")
                return
            if got is None:
                continue
            deployment_id, slot, msg = got
            if deployment_id != self.deployment_id:
                continue  # a message of an earlier deployment, late
            if slot is None:  # the node's own: it has stopped this deployment's workers
                self._stop_acked.set()
                continue
            conn, proc = self._relay_ends[slot], self.handles[slot][1]
            if isinstance(msg, WorkerExited):
                log.log(logging.DEBUG if msg.exitcode == 0 else logging.WARNING, "node %d: %s worker %d exited "
                        "(code %s)", self.node, proc.setup.role, proc.setup.index, msg.exitcode)
                conn.close()
                proc.mark_dead(msg.exitcode)
                continue
            if isinstance(msg, WorkerReady):
                proc.pid = msg.pid
            try:
                conn.send(msg)
            except OSError:
                pass  # the engine closed its end: shutting down

    def _all_dead(self, reason: str) -> None:
        self._lost = True
        live = [p for _, p in self.handles if p.is_alive()]
        if live:
            log.error("node %d lost (%s): %d worker(s) there taken for dead", self.node, reason, len(live))
        for c, (_, p) in zip(self._relay_ends, self.handles):
            if p.is_alive():
                p.reason = reason
                c.close()
                p.mark_dead(None)

    def stop(self, kill: bool) -> None:
        """Tell the node the deployment is over (idempotent); ``kill``: without a grace period."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._down.put((self.deployment_id, None, StopWorkers(kill)))
        except RendezvousError:
            pass
        for _, p in self.handles:
            p.mark_dead(p.exitcode)

    def close(self, ack_timeout_s: float = 10.0) -> None:
        if self._stopping.is_set():
            return
        self.stop(kill=False)
        if not self._lost:  # its answer: so this process may exit (and the rendezvous go) after it
            self._stop_acked.wait(ack_timeout_s)
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=2.0)
        for (c, p), r in zip(self.handles, self._relay_ends):
            c.close()
            r.close()
            p.close()
