"""PairLink: a gloo group of exactly two processes, formed once both of them ask for it.

A world of N ranks forms once, with every member present: a process that joins an elastic
deployment later (an FFN daemon started on another host while serving) cannot take a rank in it.
Two processes can always meet. Each process publishes an *incarnation* token in the cluster's
store (``PairLinks``, at its start); a pair's group meets under a prefix naming both ranks and both
tokens, so a process that takes the rank of one that left meets its peers afresh, never the
leaver's half-formed groups.

Either side asks (``PairLinks.link``) whenever it first needs the peer; a thread forms the group
once the other side has asked too. Until then it polls the store, never blocks in gloo, so a
process whose peer never comes (a joiner whose join failed) stops at once. Work that needs the
link waits: ``when_ready`` runs a callback once it has formed, ``isend`` blocks until then.
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

_POLL_S = 0.02  # how often a forming link looks for its peer in the store
_OP_TIMEOUT = timedelta(hours=24)  # an idle lane's posted receive waits that long (a dead peer fails it at once)


class PairLink:
    """The link to ``peer`` (a world rank) of ``links``' process."""

    def __init__(self, links: "PairLinks", peer: int):
        self.links, self.peer = links, peer
        self.group = None
        self.error: BaseException | None = None
        self._formed = threading.Event()
        self._stop = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._form, daemon=True, name=f"moeflow-pair-{links.me}-{peer}")
        self._thread.start()

    @property
    def formed(self) -> bool:
        return self._formed.is_set()

    def _wait_key(self, store, key: str) -> bool:
        while not self._stop.is_set():
            if store.check([key]):
                return True
            time.sleep(_POLL_S)
        return False

    def _form(self) -> None:
        me, peer, links = self.links.me, self.peer, self.links
        try:
            store = links.connect()  # a client of its own: gloo's rendezvous below uses it too
            if not self._wait_key(store, links.token_key(peer)):
                return
            tokens = {me: links.token, peer: store.get(links.token_key(peer)).decode()}
            lo, hi = sorted((me, peer))
            name = f"{links.prefix}/pair/{lo}.{tokens[lo]}-{hi}.{tokens[hi]}"
            store.set(f"{name}/asked/{me}", "1")
            if not self._wait_key(store, f"{name}/asked/{peer}"):
                return
            group = dist.ProcessGroupGloo(dist.PrefixStore(name + "/gloo", store), 0 if me == lo else 1, 2,
                                          _OP_TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - a send or post that needs the link raises it
            self.error = e
            self._formed.set()
            return
        with self._lock:
            self.group, self._peer_rank = group, 1 if me == lo else 0
            self._formed.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def when_ready(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the link has formed: now if it has, else in the thread that forms it."""
        with self._lock:
            if not self._formed.is_set():
                self._callbacks.append(fn)
                return
        if self.error is None:
            fn()

    def wait(self, timeout_s: float) -> None:
        if not self._formed.wait(timeout_s):
            raise TimeoutError(f"rank {self.links.me}: no link to rank {self.peer} within {timeout_s:g} s "
                               f"(it has not asked for one: is it up?)")
        if self.error is not None:
            raise RuntimeError(f"rank {self.links.me}: the link to rank {self.peer} failed to form: "
                               f"{self.error}") from self.error

    def isend(self, buf: torch.Tensor, tag: int):
        self.wait(self.links.timeout_s)
        return self.group.send([buf], self._peer_rank, tag)

    def irecv(self, buf: torch.Tensor, tag: int):
        return self.group.recv([buf], self._peer_rank, tag)  # only from when_ready: formed

    def stop(self) -> None:
        """A link still forming gives up (its peer never asked); a formed one stays until collected."""
        self._stop.set()


class PairLinks:
    """One process's links to its peers in deployment ``deployment_id``, meeting in the store at
    ``store_addr`` (the cluster's rendezvous). Publishes the process's incarnation token at once."""

    def __init__(self, store_addr: tuple[str, int], deployment_id: str, me: int, timeout_s: float):
        self.store_addr, self.me, self.timeout_s = store_addr, me, timeout_s
        self.prefix = f"moeflow/{deployment_id}/links"
        self.token = uuid.uuid4().hex[:12]
        self.links: dict[int, PairLink] = {}
        self.retired: list[PairLink] = []  # kept: a group collected under a thread still in a receive aborts
        self.connect().set(self.token_key(me), self.token)  # before anyone may ask for a link to us

    def connect(self):
        addr, port = self.store_addr
        return dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=self.timeout_s))

    def token_key(self, rank: int) -> str:
        return f"{self.prefix}/token/{rank}"

    def link(self, peer: int) -> PairLink:
        if peer not in self.links:
            self.links[peer] = PairLink(self, peer)
        return self.links[peer]

    def drop(self, peer: int) -> None:
        """Forget the link to ``peer`` (it left): one that joins at its rank later gets a new one."""
        link = self.links.pop(peer, None)
        if link is not None:
            link.stop()
            self.retired.append(link)

    def close(self) -> None:
        for peer in list(self.links):
            self.drop(peer)


_REGISTRY: dict[tuple[str, int], PairLinks] = {}


def pair_links(config, me: int) -> PairLinks:
    """This process's links (world rank ``me``) for ``config``'s deployment: one registry per process,
    shared by its endpoints (dispatch and combine to a peer go over one link)."""
    key = (config.deployment_id, me)
    if key not in _REGISTRY:
        _REGISTRY[key] = PairLinks(config.store, config.deployment_id, me, config.attach_timeout_s)
    return _REGISTRY[key]
