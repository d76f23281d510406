"""The KV link between a prefill server and the decode servers that take its staged requests.

A prefill server offers each finished prompt's KV as a range of its staging arena
(``kv_arena.py``); a decode server claims the range, reads it, and releases it. On the same host
the decode side's processes read the shared memory themselves (the claim only pins the range);
on another host the prefill side sends the bytes over torch.distributed (gloo), straight out of
the arena, never pickled. vLLM's NIXL connector has the same shape (the prefill side keeps its
blocks until the decode side says it read them); SGLang's bootstrap server is the port where a
decode server finds a prefill server.

Wire: the prefill server listens on its KV port (the bootstrap). A connection is greeted with a
fresh nonce; the decode server answers with the address it sends from and its proof, an HMAC of
the nonce and that address under the deployment's KV secret (``-`` without one); a prefill server
that has a secret refuses a wrong proof, naming why. Then the prefill side answers with the port
of a fresh ``TCPStore`` for that pair alone, and both sides build a two-rank ``ProcessGroupGloo``
on it (rank 0: the prefill side) within ``CONNECT_TIMEOUT``. Every message on a pair is an int64
header ``[op, transfer id, slot, offset, nbytes, token]``: the token is the range's own, drawn by
the prefill server for that handoff and known only to the two sides (the router carries it), so
nobody else can claim, pull or release the range. CLAIM and PULL are answered with one int64
status, PULL's bytes follow as one uint8 tensor. (A pair's store lives as long as its group; the
bootstrap port is a plain socket, so a restarted server binds it again while old pairs linger.)

This module knows ranges, transfer ids and bytes, not requests.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
import time

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

CLAIM, PULL, RELEASE, BYE = 1, 2, 3, 4  # ops
OK, GONE = 1, -1  # CLAIM/PULL answers: the range is there (and now claimed), or it is not
HEADER_TAG, STATUS_TAG, DATA_TAG = 80, 81, 82
HEADER_WORDS = 6
# the prefill side waits this long for a pair's next message (pairs idle between handoffs); a dead
# peer's closed socket ends the wait at once
IDLE_TIMEOUT = datetime.timedelta(days=1)
# a new pair's rendezvous (and a hello's connect) must be done within this
CONNECT_TIMEOUT = datetime.timedelta(seconds=10)
HELLO_TIMEOUT_S = 2.0  # a connection's hello line must come within this: a silent one holds a thread no longer
HELLO = "moeflow-kv 1"  # the greeting's first words: what this port speaks


def host_id() -> str:
    """What tells two processes they share a host's shared memory and network: the kernel's boot
    id and the network namespace (two namespaces are two hosts here, as in the tests' netns hosts)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


def route_source(peer_addr: str) -> str:
    """The local address the kernel would send from to reach ``peer_addr`` (no packet is sent)."""
    infos = socket.getaddrinfo(peer_addr, 9, type=socket.SOCK_DGRAM)
    family, _, _, _, target = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(target)
        return s.getsockname()[0]


def pair_group(store: TCPStore, rank: int, local_addr: str) -> ProcessGroupGloo:
    """The two-rank gloo group of one pair (blocks until the other side builds it too, at most
    ``CONNECT_TIMEOUT``; each operation on it then waits as long as its ``wait`` says)."""
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=local_addr)]  # the address the peer can reach
    opts._timeout = CONNECT_TIMEOUT
    return ProcessGroupGloo(PrefixStore("kv/pair/", store), rank, 2, opts)


class Refused(ConnectionError):
    """The prefill server's KV port would not pair with us; the message says why."""


def proof(secret: str | None, nonce: str, addr: str) -> str:
    """What a decode server answers a greeting with: the HMAC of the nonce and its address under the
    KV secret, or ``-`` without one."""
    if not secret:
        return "-"
    return hmac.new(secret.encode(), f"{nonce} {addr}".encode(), hashlib.sha256).hexdigest()


def greeting() -> tuple[str, str]:
    """A fresh nonce and the line that carries it."""
    nonce = secrets.token_hex(16)
    return nonce, f"{HELLO} {nonce}\n"


def connect(host: str, port: int, secret: str | None) -> ProcessGroupGloo:
    """The decode side of a new pair with the prefill server whose KV port is ``host:port``."""
    local = route_source(host)
    with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT.total_seconds()) as s:
        hello = read_line(s)
        if not hello.startswith(HELLO + " "):
            raise Refused(f"{host}:{port} is not a moeflow KV port (it said {hello[:60]!r})")
        s.sendall(f"{local} {proof(secret, hello.split()[-1], local)}\n".encode())
        word, _, rest = read_line(s).partition(" ")
        if word != "ok":
            raise Refused(f"the KV port {host}:{port} refused this decode server: {rest}")
        store_port = int(rest)
    store = TCPStore(host, store_port, None, False, CONNECT_TIMEOUT)
    return pair_group(store, 1, local)


def read_line(s: socket.socket, limit: int = 256, deadline_s: float | None = None) -> str:
    """One line of at most ``limit`` bytes, all of it by ``deadline_s`` (monotonic; None: each read
    waits as long as the socket's timeout)."""
    buf = b""
    while not buf.endswith(b"\n"):
        if deadline_s is not None:
            left = deadline_s - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the KV bootstrap's peer sent no whole line in time ({buf[:60]!r})")
            s.settimeout(left)
        chunk = s.recv(limit)
        if not chunk or len(buf) > limit:
            raise ConnectionError(f"the KV bootstrap closed the connection mid-line ({buf!r})")
        buf += chunk
    return buf.decode().strip()


def header(op: int, transfer_id: int = 0, slot: int = 0, offset: int = 0, nbytes: int = 0,
           token: int = 0) -> torch.Tensor:
    return torch.tensor([op, transfer_id, slot, offset, nbytes, token], dtype=torch.int64, device="cpu")  # gloo: host


def new_token() -> int:
    """A range's token: 63 random bits (an int64 header word, positive)."""
    return secrets.randbits(63)
