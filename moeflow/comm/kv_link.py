"""The KV link between a prefill server and the decode servers that take its staged requests.

A prefill server offers each finished prompt's KV as a range of its staging arena
(``kv_arena.py``); a decode server claims the range, reads it, and releases it. On the same host
the decode side's processes read the shared memory themselves (the claim only pins the range);
on another host the prefill side sends the bytes over torch.distributed (gloo), straight out of
the arena, never pickled. vLLM's NIXL connector has the same shape (the prefill side keeps its
blocks until the decode side says it read them); SGLang's bootstrap server is the port where a
decode server finds a prefill server.

Wire: the prefill server listens on its KV port (the bootstrap). A decode server connects and
names the address it sends from; the prefill side answers with the port of a fresh ``TCPStore``
for that pair alone, and both sides build a two-rank ``ProcessGroupGloo`` on it (rank 0: the
prefill side). Every message on a pair is an int64 header ``[op, transfer id, slot, offset,
nbytes]``; CLAIM and PULL are answered with one int64 status, PULL's bytes follow as one uint8
tensor. (A pair's store lives as long as its group; the bootstrap port is a plain socket, so a
restarted server binds it again while old pairs linger.)

This module knows ranges, transfer ids and bytes, not requests.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

CLAIM, PULL, RELEASE, BYE = 1, 2, 3, 4  # ops
OK, GONE = 1, -1  # CLAIM/PULL answers: the range is there (and now claimed), or it is not
HEADER_TAG, STATUS_TAG, DATA_TAG = 80, 81, 82
HEADER_WORDS = 5
# a pair waits this long for its peer's next message (pairs idle between handoffs) or for its
# peer to join; a dead peer's closed socket ends it at once
PAIR_TIMEOUT = datetime.timedelta(days=1)
CONNECT_TIMEOUT = datetime.timedelta(seconds=10)


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


def pair_group(store: TCPStore, rank: int, local_addr: str,
               timeout: datetime.timedelta = PAIR_TIMEOUT) -> ProcessGroupGloo:
    """The two-rank gloo group of one pair (blocks until the other side builds it too)."""
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=local_addr)]  # the address the peer can reach
    opts._timeout = timeout
    return ProcessGroupGloo(PrefixStore("kv/pair/", store), rank, 2, opts)


def connect(host: str, port: int, timeout: datetime.timedelta) -> ProcessGroupGloo:
    """The decode side of a new pair with the prefill server whose KV port is ``host:port``."""
    local = route_source(host)
    with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT.total_seconds()) as s:
        s.sendall(f"{local}\n".encode())
        store_port = int(read_line(s))
    store = TCPStore(host, store_port, None, False, CONNECT_TIMEOUT)
    return pair_group(store, 1, local, timeout)


def read_line(s: socket.socket, limit: int = 256) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(limit)
        if not chunk or len(buf) > limit:
            raise ConnectionError(f"the KV bootstrap closed the connection mid-line ({buf!r})")
        buf += chunk
    return buf.decode().strip()


def header(op: int, transfer_id: int = 0, slot: int = 0, offset: int = 0, nbytes: int = 0) -> torch.Tensor:
    return torch.tensor([op, transfer_id, slot, offset, nbytes], dtype=torch.int64, device="cpu")  # gloo: host
