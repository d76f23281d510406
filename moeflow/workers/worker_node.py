"""A worker node (``moeflow worker-node``, or ``moeflow serve --node-rank R`` with R > 0).

It runs no engine: it connects to node 0's rendezvous, beats a heartbeat, and waits. For each
deployment node 0 starts (a restart included) it receives ``StartWorkers``, spawns those workers
here, and relays: the engine's messages to each worker's pipe, and each worker's messages (and
its exit, ``WorkerExited``) back. ``StopWorkers`` ends the deployment; the node waits for the
next. When node 0 goes away, the node stops its workers and exits.

The workers load only their own weights from the same checkpoint path as node 0 (a copy on every
host, as vLLM assumes).
"""
from __future__ import annotations

import threading
from multiprocessing.connection import wait

from moeflow.comm import cleanup
from moeflow.config import ClusterConfig
from moeflow.logs import get_logger
from moeflow.messages import KillWorker, StartWorkers, StopWorkers, WorkerExited, WorkerFailed
from moeflow.workers.interface import choose
from moeflow.workers.launch import WorkerHandle, spawn, stop_workers
from moeflow.workers.rendezvous import (Channel, Heartbeat, RendezvousError, connect, is_closed, node_inbox,
                                        node_outbox)

log = get_logger("moeflow.workers.worker_node")

_HEARTBEAT_S = 0.5
_POLL_S = 0.1


class NodeWorkers:
    """This node's workers of one deployment, and the relay of their messages up."""

    def __init__(self, start: StartWorkers, outbox: Channel):
        self.deployment_id, self.outbox = start.deployment_id, outbox
        self.workers: list[WorkerHandle] = []
        self._stop = threading.Event()
        self._stopping = False  # stopping: the relay ends once every worker's exit is reported
        self.add(start)
        self._thread = threading.Thread(target=self._relay_up, daemon=True, name="moeflow-relay-up")
        self._thread.start()

    def add(self, start: StartWorkers) -> None:
        """Start ``start``'s workers (at the deployment's start, or joining it while it serves)."""
        mine = [spawn(s) for s in start.setups]
        self.workers.extend(mine)
        log.info("deployment %s: started %s", self.deployment_id,
                 ", ".join(f"{w.role} {w.index} (pid {w.process.pid})" for w in mine))

    def send(self, slot: int, msg) -> None:
        if isinstance(msg, KillWorker):  # for us: it did not stop when asked
            self.workers[slot].process.kill()
            return
        try:
            self.workers[slot].conn.send(msg)
        except OSError:
            pass  # it died: its exit is on its way up

    def _relay_up(self) -> None:
        conns: dict = {}
        sentinels: dict = {}
        known = 0
        while not self._stop.is_set() and (sentinels or not self._stopping):
            for slot in range(known, len(self.workers)):  # those that joined since
                w = self.workers[slot]
                conns[w.conn], sentinels[w.process.sentinel] = slot, slot
            known = len(self.workers)
            if not sentinels:
                self._stop.wait(_POLL_S)
                continue
            for ready in wait(list(conns) + list(sentinels), timeout=_POLL_S):
                if ready in conns:
                    slot = conns[ready]
                    try:
                        msg = ready.recv()
                    except (EOFError, OSError):
                        conns.pop(ready)
                        continue
                else:  # exited: report after whatever it sent last (its WorkerFailed)
                    slot = sentinels.pop(ready)
                    w = self.workers[slot]
                    conn = next((c for c, s in conns.items() if s == slot), None)
                    while conn is not None and conn.poll():
                        try:
                            self._put(slot, conn.recv())
                        except (EOFError, OSError):
                            break
                    conns.pop(conn, None)
                    w.process.join(timeout=1.0)
                    msg = WorkerExited(w.process.exitcode)
                self._put(slot, msg)

    def _put(self, slot: int, msg) -> None:
        try:
            self.outbox.put((self.deployment_id, slot, msg))
        except RendezvousError:
            self._stop.set()

    def stop(self, kill: bool, grace_s: float = 5.0) -> None:
        self._stopping = True
        stop_workers(self.workers, 0.0 if kill else grace_s)
        self._thread.join(timeout=2.0)  # reports the exits it has not yet
        self._stop.set()
        self._thread.join(timeout=1.0)  # it waits on the sentinels that closing the handles releases
        for w in self.workers:
            w.close()
        cleanup(self.deployment_id)


def _beat(heartbeat: Heartbeat, lost: threading.Event) -> None:
    while not lost.is_set():
        try:
            heartbeat.beat()
        except RuntimeError:
            lost.set()
            return
        lost.wait(_HEARTBEAT_S)


def refuse(start: StartWorkers, cluster: ClusterConfig, outbox: Channel) -> bool:
    """Whether node 0's deployment counts other hosts than this node was told; if so every worker
    fails at once with the reason (node 0 raises it) rather than waiting for a world that never forms."""
    theirs = start.setups[0].engine.cluster.nnodes if start.setups else cluster.nnodes
    if theirs == cluster.nnodes:
        return False
    reason = f"worker node {cluster.node_rank} was started with --nnodes {cluster.nnodes}; node 0 runs {theirs}"
    log.error("deployment %s refused: %s", start.deployment_id, reason)
    for slot, s in enumerate(start.setups):
        outbox.put((start.deployment_id, slot, WorkerFailed(s.role, s.index, reason)))
    return True


def run_worker_node(cluster: ClusterConfig) -> int:
    """Serve deployments of node 0 until it goes away; returns the process's exit code."""
    if cluster.node_rank == 0:
        raise ValueError("node 0 runs the engine (moeflow serve), not a worker node")
    k = cluster.node_rank
    iface = choose(cluster.master_addr)  # before waiting: a host the others cannot reach fails now
    log.info("node %d: gloo between hosts on %s (%s, chosen by %s)", k, iface.name, iface.addr, iface.chosen_by)
    log.info("node %d of %d: waiting for node 0 at %s:%d", k, cluster.nnodes, cluster.master_addr,
             cluster.master_port)
    inbox = Channel(connect(cluster), node_inbox(k))
    outbox = Channel(connect(cluster), node_outbox(k))
    lost = threading.Event()
    beat = threading.Thread(target=_beat, args=(Heartbeat(connect(cluster), k), lost), daemon=True)
    beat.start()
    current: NodeWorkers | None = None
    try:
        while not lost.is_set():
            got = inbox.get(_POLL_S)
            if got is None:
                if is_closed(inbox.store):
                    break
                continue
            deployment_id, slot, msg = got
            if isinstance(msg, StartWorkers):
                if current is not None and deployment_id == current.deployment_id:
                    current.add(msg)  # members that join the running deployment
                    continue
                if current is not None:  # node 0 gave the last one up without a word
                    current.stop(kill=True)
                    current = None
                if refuse(msg, cluster, outbox):
                    continue
                current = NodeWorkers(msg, outbox)
            elif isinstance(msg, StopWorkers):
                if current is not None and deployment_id == current.deployment_id:
                    current.stop(kill=msg.kill)
                    log.info("deployment %s: stopped", deployment_id)
                    current = None
                outbox.put((deployment_id, None, msg))  # the answer node 0 waits for (refused ones too)
            elif current is None or deployment_id != current.deployment_id:
                continue  # for a deployment that is over
            else:
                current.send(slot, msg)
    except RendezvousError as e:
        log.info("node 0 is gone (%s)", e)
    finally:
        running = current is not None
        if running:
            current.stop(kill=True)
        # the heartbeat must not be inside a store call when the interpreter ends: once node 0 is
        # gone that call raises in a thread being torn down, and the process aborts (SIGABRT)
        lost.set()
        beat.join(timeout=_HEARTBEAT_S + 10)
    if running:  # node 0 ended without stopping its deployment: it crashed, or was killed
        log.error("node %d: node 0 went away in the middle of deployment %s; its workers here are stopped", k,
                  current.deployment_id)
        return 1
    log.info("node %d: node 0 has ended; exiting", k)
    return 0
