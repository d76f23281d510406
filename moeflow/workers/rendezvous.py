"""The rendezvous of a deployment that spans hosts: one torch.distributed TCPStore on node 0.

Everything the hosts say to each other besides tensors goes through it (the issue's "no second
ad-hoc channel"): the setups of each node's workers, their control messages both ways, heartbeats,
and the gloo world's own rendezvous (under a key prefix, ``workers/world.py``). Node 0's engine
process hosts it for its lifetime (restarts included); the other nodes connect as clients.

A ``Channel`` is a FIFO of pickled objects (the store's queue_push / queue_pop), one writer and one
reader. NOTE: a reader polls ``queue_len`` with a backoff (0.5 ms, doubling to 1 ms while the
channel is busy, 10 ms once it has been idle for a second) instead of a blocking pop:
the store's blocking calls only time out with a C++ warning on stderr each time, and a reader has
to look up now and then (a stop flag, a heartbeat).
"""
from __future__ import annotations

import atexit
import pickle
import time
from datetime import timedelta

import torch.distributed as dist

from moeflow.config import ClusterConfig

_MIN_NAP_S, _BUSY_NAP_S, _MAX_NAP_S = 0.0005, 0.001, 0.01
_BUSY_S = 1.0  # a channel that carried something this recently is busy
CLOSED_KEY = "moeflow/closed"  # set by node 0's process as it ends
_servers: dict[int, dist.TCPStore] = {}  # port -> the store this process hosts (node 0)


class RendezvousError(RuntimeError):
    """Node 0 could not be reached, or stopped answering."""


def host(cluster: ClusterConfig) -> dist.TCPStore:
    """Node 0: the store on ``master_port`` (on every interface), started once per process; under
    torchrun, its agent's store. When this process ends, it marks the rendezvous closed, so that
    the worker nodes end too (torchrun's store outlives us: its agents wait for every node)."""
    store = _servers.get(cluster.master_port)
    if store is None:
        if cluster.agent_store:
            store = connect(cluster)
        else:
            try:
                store = dist.TCPStore("0.0.0.0", cluster.master_port, None, True, wait_for_workers=False,
                                      timeout=timedelta(seconds=cluster.connect_timeout_s))
            except (RuntimeError, OSError) as e:
                raise RendezvousError(f"node 0 cannot host the rendezvous on port {cluster.master_port}: "
                                      f"{e}") from None
        _servers[cluster.master_port] = store
        atexit.register(_close, cluster.master_port)
    return store


def _close(port: int) -> None:
    store = _servers.pop(port, None)
    if store is not None:
        try:
            store.set(CLOSED_KEY, b"1")
        except RuntimeError:
            pass


def is_closed(store: dist.TCPStore) -> bool:
    """Whether node 0 has ended (a worker node asks; an unreachable store raises RendezvousError)."""
    try:
        return store.check([CLOSED_KEY])
    except RuntimeError as e:
        raise RendezvousError(f"rendezvous lost: {e}") from None


def connect(cluster: ClusterConfig, timeout_s: float | None = None) -> dist.TCPStore:
    """A client connection to node 0's store (a thread that polls wants its own: calls serialize)."""
    timeout_s = cluster.connect_timeout_s if timeout_s is None else timeout_s
    try:
        return dist.TCPStore(cluster.master_addr, cluster.master_port, None, False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise RendezvousError(f"no rendezvous at {cluster.master_addr}:{cluster.master_port} after "
                              f"{timeout_s:g} s (is node 0 up, and the address reachable from here?): {e}") from None


class Channel:
    """One direction of one conversation: ``put`` pickles an object onto the queue ``name``."""

    def __init__(self, store: dist.TCPStore, name: str):
        self.store, self.name = store, name
        self._nap_s = _MIN_NAP_S
        self._last_s = 0.0  # when the last object came

    def put(self, obj) -> None:
        try:
            self.store.queue_push(self.name, pickle.dumps(obj))
        except RuntimeError as e:
            raise RendezvousError(f"rendezvous lost while sending on {self.name}: {e}") from None

    def get(self, timeout_s: float):
        """The next object, or None when nothing came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.store.queue_len(self.name) > 0:
                    self._nap_s, self._last_s = _MIN_NAP_S, time.monotonic()
                    return pickle.loads(self.store.queue_pop(self.name, False))
            except RuntimeError as e:
                raise RendezvousError(f"rendezvous lost while receiving on {self.name}: {e}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self._nap_s, left))
            # a conversation in progress (a step loop) is polled at most 1 ms apart, an idle one 10 ms
            busy = time.monotonic() - self._last_s < _BUSY_S
            self._nap_s = min(2 * self._nap_s, _BUSY_NAP_S if busy else _MAX_NAP_S)


class Heartbeat:
    """A counter a node bumps every ``period_s``; the other side sees it stall."""

    def __init__(self, store: dist.TCPStore, node: int):
        self.store, self.key = store, f"moeflow/heartbeat/{node}"
        self._last, self._seen_at = -1, time.monotonic()

    def beat(self) -> None:
        self.store.add(self.key, 1)

    @property
    def has_beaten(self) -> bool:
        """Whether the node ever beat (connected), as of the last ``silent_s``."""
        return self._last > 0

    def silent_s(self) -> float:
        """Seconds since the counter last moved (as seen by this reader; at first, since we looked)."""
        n = self.store.add(self.key, 0)
        now = time.monotonic()
        if n != self._last:
            if self._last >= 0:
                self._seen_at = now
            self._last = n
        return now - self._seen_at


def node_inbox(node: int) -> str:
    """Where the engine posts a node's StartWorkers / StopWorkers and its workers' messages."""
    return f"moeflow/node{node}/down"


def node_outbox(node: int) -> str:
    """Where a node posts its workers' messages (and WorkerExited) to the engine."""
    return f"moeflow/node{node}/up"
