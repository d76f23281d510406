"""The prefill side of the KV link (``kv_link.py``): the ranges it offers, and the threads that
answer the decode servers' hellos, claims, pulls and releases.

An offered range lives until its decode server releases it, or until its lease runs out while
nobody has claimed it. A claimed range is being read (by the decode host's processes, or by a
pull): it outlives its lease until released by the pair that claimed it, or until that pair ends
(the decode server died), at most one more lease. Every claim, pull and release must name the
range's token (``kv_link.new_token``); a release from outside the pairs (the router's, over HTTP)
frees only a range nobody claimed. The engine thread calls ``reap`` each step and frees what it
returns; the pair threads never free anything themselves, so a range is never reused under a reader.

The port is open to whoever can reach it, so it is bounded: hellos are read off the accept thread
(a silent connection delays nobody), at most ``MAX_PENDING`` connections are between their hello
and a working pair at once and at most ``MAX_PAIRS`` pairs live at once (past either a connection
is refused at once, saying so), a hello must come within ``HELLO_TIMEOUT_S`` and the pair's
rendezvous within ``CONNECT_TIMEOUT``.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moeflow.comm.kv_arena import KvArena, gloo_buffer
from moeflow.comm.kv_link import (BYE, CLAIM, CONNECT_TIMEOUT, DATA_TAG, GONE, HEADER_TAG, HEADER_WORDS,
                                  HELLO_TIMEOUT_S, IDLE_TIMEOUT, OK, PULL, RELEASE, STATUS_TAG, TCPStore, greeting, pair_group, proof,
                                  read_line, route_source)
from moeflow.kv_handle import REFUSED, RELEASED, UNKNOWN

logger = logging.getLogger("moeflow.kv")

MAX_PENDING = 16  # connections between their hello and a working pair, at once
MAX_PAIRS = 64  # live pairs (one per decode server process that reads from this one)


@dataclass
class Offer:
    slot: int
    offset_bytes: int
    nbytes: int
    token: int  # known only to this server and the handoff's two ends: names the range in every request
    deadline_s: float  # unclaimed past this: freed (the lease ran out)
    pair: int | None = None  # the pair that claimed it
    released: bool = False
    # a range held in place (not in the arena): what a pull sends, gathered when asked ([nbytes] uint8)
    gather: Callable[[], torch.Tensor] | None = None


class Offers:
    """The offered ranges by transfer id; any thread (one lock)."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self._lock = threading.Lock()
        self._offers: dict[int, Offer] = {}
        self._gone_pairs: set[int] = set()
        self.expired = 0  # leases that ran out unclaimed, or claimed by a pair that ended

    def offer(self, transfer_id: int, slot: int, offset_bytes: int, nbytes: int, token: int,
              gather: Callable[[], torch.Tensor] | None = None) -> None:
        """``gather``: the range is held in place, not in the arena; a pull sends what it returns."""
        with self._lock:
            self._offers[transfer_id] = Offer(slot, offset_bytes, nbytes, token, self.clock() + self.lease_s,
                                              gather=gather)

    def gather_of(self, transfer_id: int) -> Callable[[], torch.Tensor] | None:
        with self._lock:
            o = self._offers.get(transfer_id)
            return None if o is None else o.gather

    def claim(self, transfer_id: int, slot: int, offset_bytes: int, nbytes: int, token: int, pair: int) -> bool:
        """Pin the range for ``pair``; False when it is not offered (any more), names other bytes, or
        the token is not the range's."""
        with self._lock:
            o = self._offers.get(transfer_id)
            if (o is None or o.released or not _same(o.token, token) or (o.pair is not None and o.pair != pair)
                    or (o.slot, o.offset_bytes) != (slot, offset_bytes) or nbytes > o.nbytes):
                return False
            if o.pair is None:
                o.pair, o.deadline_s = pair, self.clock() + self.lease_s  # the reader has one more lease
            return True

    def release(self, transfer_id: int, token: int, pair: int | None = None) -> str:
        """The range may be freed: asked by ``pair`` (None: from outside the pairs, the router's). A
        wrong token is ``REFUSED``, as is an outside release of a range a pair has claimed (only its
        reader knows when it is read)."""
        with self._lock:
            o = self._offers.get(transfer_id)
            if o is None or o.released:
                return UNKNOWN
            if not _same(o.token, token) or (o.pair is not None and o.pair != pair):
                return REFUSED
            o.released = True
            return RELEASED

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


def _same(token: int, given: int) -> bool:
    """``given`` is ``token`` (compared in constant time: a guesser learns nothing from the timing)."""
    return 0 <= given < 1 << 63 and hmac.compare_digest(token.to_bytes(8, "little"), given.to_bytes(8, "little"))


class KvServer:
    """The bootstrap listener on ``host:port`` (0: any free port; ``port`` says which), a thread per
    connection until its pair works, then per pair. ``secret``: what a decode server's hello must
    prove it knows (None: any decode server that can reach the port may pair)."""

    def __init__(self, arena: KvArena, offers: Offers, host: str, port: int, secret: str | None = None):
        self.arena, self.offers, self._secret = arena, offers, secret
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._stopping = False
        self._next_pair = itertools.count(1)
        self._lock = threading.Lock()
        self.num_pending = self.num_pairs = 0
        self.refused = 0  # connections turned away (busy, or a wrong proof)
        self._accept = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: we are shutting down
                return
            with self._lock:
                busy = self.num_pending >= MAX_PENDING or self.num_pairs >= MAX_PAIRS
                if not busy:
                    self.num_pending += 1
            if busy:
                self._refuse(conn, f"busy ({MAX_PENDING} connections pairing, at most {MAX_PAIRS} pairs); "
                                   f"retry later")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-hello", daemon=True).start()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        with self._lock:
            self.refused += 1
        try:
            conn.settimeout(1.0)
            conn.sendall(f"refused {why}\n".encode())
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: its hello, its pair's rendezvous, then the pair."""
        pair, peer, pg, store = next(self._next_pair), "?", None, None
        try:
            try:
                deadline = time.monotonic() + HELLO_TIMEOUT_S
                conn.settimeout(HELLO_TIMEOUT_S)
                nonce, hello = greeting()
                conn.sendall(hello.encode())
                peer, _, given = read_line(conn, deadline_s=deadline).partition(" ")
                if self._secret and not hmac.compare_digest(given.encode(), proof(self._secret, nonce, peer).encode()):
                    return self._refuse(conn, "this decode server does not know the KV secret (--kv-secret or "
                                              "$MOEFLOW_KV_SECRET must be the prefill server's)")
                store = TCPStore(self.host, 0, None, True, CONNECT_TIMEOUT, wait_for_workers=False)
                conn.sendall(f"ok {store.port}\n".encode())
                pg = pair_group(store, 0, route_source(peer))
            except (OSError, ValueError, RuntimeError) as e:  # a client that left or stalled mid-hello
                logger.debug("KV bootstrap: a connection from %s failed: %s: %s", peer, type(e).__name__, e)
                return conn.close()
            finally:
                with self._lock:
                    self.num_pending -= 1
                    self.num_pairs += pg is not None
            conn.close()
            self._serve_pair(pair, peer, pg)
        finally:
            if pg is not None:
                with self._lock:
                    self.num_pairs -= 1

    def _serve_pair(self, pair: int, peer_addr: str, pg) -> None:
        hdr = torch.empty(HEADER_WORDS, dtype=torch.int64, device="cpu")  # gloo: host tensors
        status = torch.empty(1, dtype=torch.int64, device="cpu")
        try:
            while True:
                pg.recv([hdr], 1, HEADER_TAG).wait(IDLE_TIMEOUT)
                op, tid, slot, offset, nbytes, token = hdr.tolist()
                if op == BYE:
                    break
                if op == RELEASE:
                    self.offers.release(tid, token, pair)
                    continue
                ok = (op in (CLAIM, PULL) and not self._stopping
                      and self.offers.claim(tid, slot, offset, nbytes, token, pair))
                view = None
                if ok and op == PULL:
                    try:
                        view = self._bytes(tid, offset, nbytes)
                    except Exception as e:  # noqa: BLE001  (that range's failure, answered as GONE)
                        logger.warning("KV transfer %d: gathering it for a pull failed: %s: %s", tid,
                                       type(e).__name__, e)
                        ok = False
                status[0] = OK if ok else GONE
                pg.send([status], 1, STATUS_TAG).wait(CONNECT_TIMEOUT)
                if ok and op == PULL:
                    data = gloo_buffer(view)
                    if data is not view:  # a device heap: through pinned host memory
                        data.copy_(view)
                    pg.send([data], 1, DATA_TAG).wait(IDLE_TIMEOUT)  # as long as the bytes take; a dead peer ends it
        except Exception as e:  # noqa: BLE001  (the decode server went away: what it claimed is freed)
            if not self._stopping:
                logger.info("KV link pair %d (%s) ended: %s: %s", pair, peer_addr, type(e).__name__, e)
        finally:
            self.offers.pair_gone(pair)

    def _bytes(self, tid: int, offset: int, nbytes: int) -> torch.Tensor:
        """What a pull of range ``tid`` sends: its arena bytes, or a range held in place gathered now."""
        gather = self.offers.gather_of(tid)
        if gather is None:
            return self.arena.heap_view(offset, nbytes)
        data = gather()
        if data.numel() != nbytes:
            raise ValueError(f"gathered {data.numel()} bytes for a pull of {nbytes}")
        return data

    def shutdown(self) -> None:
        """Stop accepting; a pair still open answers GONE to everything until its decode server says BYE."""
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a bare close does not, on Linux)
        except OSError:
            pass
        self._listener.close()
        self._accept.join(2.0)
