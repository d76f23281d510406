"""The prefill side of the KV link (``kv_link.py``): the ranges it offers, and the threads that
answer the decode servers' claims, pulls and releases.

An offered range lives until its decode server releases it, or until its lease runs out while
nobody has claimed it. A claimed range is being read (by the decode host's processes, or by a
pull): it outlives its lease until released, or until its pair ends (the decode server died), at
most one more lease. The engine thread calls ``reap`` each step and frees what it returns; the
pair threads never free anything themselves, so a range is never reused under a reader.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass

import torch

from moeflow.comm.kv_arena import KvArena, gloo_buffer
from moeflow.comm.kv_link import (BYE, CLAIM, CONNECT_TIMEOUT, DATA_TAG, GONE, HEADER_TAG, HEADER_WORDS, OK,
                                  PULL, RELEASE, STATUS_TAG, TCPStore, pair_group, read_line, route_source)

logger = logging.getLogger("moeflow.kv")


@dataclass
class Offer:
    slot: int
    offset_bytes: int
    nbytes: int
    deadline_s: float  # unclaimed past this: freed (the lease ran out)
    pair: int | None = None  # the pair that claimed it
    released: bool = False


class Offers:
    """The offered ranges by transfer id; any thread (one lock)."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self._lock = threading.Lock()
        self._offers: dict[int, Offer] = {}
        self._gone_pairs: set[int] = set()
        self.expired = 0  # leases that ran out unclaimed, or claimed by a pair that ended

    def offer(self, transfer_id: int, slot: int, offset_bytes: int, nbytes: int) -> None:
        with self._lock:
            self._offers[transfer_id] = Offer(slot, offset_bytes, nbytes, self.clock() + self.lease_s)

    def claim(self, transfer_id: int, slot: int, offset_bytes: int, nbytes: int, pair: int) -> bool:
        """Pin the range for ``pair``; False when it is not offered (any more) or names other bytes."""
        with self._lock:
            o = self._offers.get(transfer_id)
            if (o is None or o.released or (o.pair is not None and o.pair != pair)
                    or (o.slot, o.offset_bytes) != (slot, offset_bytes) or nbytes > o.nbytes):
                return False
            if o.pair is None:
                o.pair, o.deadline_s = pair, self.clock() + self.lease_s  # the reader has one more lease
            return True

    def release(self, transfer_id: int) -> None:
        with self._lock:
            if (o := self._offers.get(transfer_id)) is not None:
                o.released = True

    def pair_gone(self, pair: int) -> None:
        with self._lock:
            self._gone_pairs.add(pair)

    def reap(self) -> list[int]:
        """Engine thread: the transfer ids whose ranges can be freed now (forgotten here)."""
        now, out = self.clock(), []
        with self._lock:
            for tid, o in list(self._offers.items()):
                dead = o.pair is not None and o.pair in self._gone_pairs
                if o.released or dead or now > o.deadline_s:
                    if not o.released:
                        self.expired += 1
                    out.append(tid)
                    del self._offers[tid]
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._offers)


class KvServer:
    """The bootstrap listener on ``host:port`` (0: any free port; ``port`` says which) and a thread per
    decode server that connected."""

    def __init__(self, arena: KvArena, offers: Offers, host: str, port: int):
        self.arena, self.offers = arena, offers
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._stopping = False
        self._next_pair = itertools.count(1)
        self._accept = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: we are shutting down
                return
            try:
                with conn:
                    conn.settimeout(CONNECT_TIMEOUT.total_seconds())
                    peer = read_line(conn)
                    store = TCPStore(self.host, 0, None, True, CONNECT_TIMEOUT, wait_for_workers=False)
                    conn.sendall(f"{store.port}\n".encode())
            except (OSError, ValueError, RuntimeError) as e:  # a client that left mid-hello; the next one is served
                logger.info("KV bootstrap: a connection failed: %s: %s", type(e).__name__, e)
                continue
            pair = next(self._next_pair)
            threading.Thread(target=self._serve_pair, args=(pair, peer, store), name=f"kv-pair-{pair}",
                             daemon=True).start()

    def _serve_pair(self, pair: int, peer_addr: str, store: TCPStore) -> None:
        hdr = torch.empty(HEADER_WORDS, dtype=torch.int64, device="cpu")  # gloo: host tensors
        status = torch.empty(1, dtype=torch.int64, device="cpu")
        try:
            pg = pair_group(store, 0, route_source(peer_addr))
            while True:
                pg.recv([hdr], 1, HEADER_TAG).wait()
                op, tid, slot, offset, nbytes = hdr.tolist()
                if op == BYE:
                    break
                if op == RELEASE:
                    self.offers.release(tid)
                    continue
                ok = op in (CLAIM, PULL) and not self._stopping and self.offers.claim(tid, slot, offset, nbytes, pair)
                status[0] = OK if ok else GONE
                pg.send([status], 1, STATUS_TAG).wait()
                if ok and op == PULL:
                    view = self.arena.heap_view(offset, nbytes)
                    data = gloo_buffer(view)
                    if data is not view:  # a device heap: through pinned host memory
                        data.copy_(view)
                    pg.send([data], 1, DATA_TAG).wait()
        except Exception as e:  # noqa: BLE001  (the decode server went away: what it claimed is freed)
            if not self._stopping:
                logger.info("KV link pair %d (%s) ended: %s: %s", pair, peer_addr, type(e).__name__, e)
        finally:
            self.offers.pair_gone(pair)

    def shutdown(self) -> None:
        """Stop accepting; a pair still open answers GONE to everything until its decode server says BYE."""
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a bare close does not, on Linux)
        except OSError:
            pass
        self._listener.close()
        self._accept.join(2.0)
