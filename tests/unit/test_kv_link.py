"""The KV link's pieces: the prefill side's offers (leases, claims, releases, a reader that dies,
tokens), the handle's JSON form and its validation, a real pull over a gloo pair on loopback (bytes
equal, a released range answers GONE, the bootstrap port is bound again after a shutdown), and the
port's guards (a secret, silent and flooding connections)."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from moeflow.comm.kv_arena import KvArena, arena_path
from moeflow.comm.kv_client import KvClient, RemoteRange
from moeflow.comm.kv_server import MAX_PENDING, KvServer, Offers
from moeflow.kv_handle import REFUSED, RELEASED, UNKNOWN, KvHandle, KvLayout


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


T1, T2, T3 = 0x1111, 0x2222, 0x3333  # the ranges' tokens


def test_offers_lease_claim_release_and_a_dead_reader():
    clock = Clock()
    o = Offers(lease_s=10.0, clock=clock)
    o.offer(1, slot=0, offset_bytes=0, nbytes=100, token=T1)
    o.offer(2, slot=1, offset_bytes=128, nbytes=100, token=T2)
    o.offer(3, slot=2, offset_bytes=256, nbytes=100, token=T3)
    assert not o.claim(1, slot=0, offset_bytes=64, nbytes=100, token=T1, pair=7)  # other bytes than offered
    assert not o.claim(1, slot=0, offset_bytes=0, nbytes=101, token=T1, pair=7)
    assert o.claim(1, 0, 0, 100, T1, pair=7) and o.claim(1, 0, 0, 100, T1, pair=7)  # the same reader may ask again
    assert not o.claim(1, 0, 0, 100, T1, pair=8)  # another one may not
    assert o.claim(2, 1, 128, 100, T2, pair=8)
    clock.now = 5.0
    assert o.reap() == []
    assert o.release(3, T3) == RELEASED
    assert o.reap() == [3] and o.expired == 0  # released: freed, not counted as expired
    o.pair_gone(8)
    assert o.reap() == [2] and o.expired == 1  # its reader died mid-read
    clock.now = 10.5  # claimed at 0: the claim gave one more lease from then
    assert o.reap() == [1] and o.expired == 2
    assert not o.claim(1, 0, 0, 100, T1, pair=7) and len(o) == 0


def test_a_range_answers_only_to_its_token_and_a_claimed_one_only_to_its_reader():
    """The red-team's forged release: whoever knows a server id and a transfer id (they count up)
    could free a range, even one a decode server was reading."""
    o = Offers(lease_s=10.0, clock=Clock())
    o.offer(1, 0, 0, 100, token=T1)
    o.offer(2, 1, 128, 100, token=T2)
    assert not o.claim(1, 0, 0, 100, token=T2, pair=7)  # another range's token
    assert not o.claim(1, 0, 0, 100, token=-T1, pair=7)  # a header word is signed: no wrap-around
    assert o.release(1, token=T1 + 1) == REFUSED and o.release(1, token=0) == REFUSED
    assert o.claim(1, 0, 0, 100, token=T1, pair=7)
    assert o.release(1, token=T1) == REFUSED  # from outside the pairs (the HTTP route): claimed, so not yours
    assert o.release(1, token=T1, pair=8) == REFUSED  # another pair
    assert o.reap() == []  # nothing was freed by any of that
    assert o.release(1, token=T1, pair=7) == RELEASED and o.release(1, token=T1, pair=7) == UNKNOWN
    assert o.release(2, token=T2) == RELEASED  # unclaimed: the router may free it
    assert sorted(o.reap()) == [1, 2] and o.release(9, token=T1) == UNKNOWN


def test_an_unclaimed_offer_expires_with_its_lease():
    clock = Clock()
    o = Offers(lease_s=1.0, clock=clock)
    o.offer(5, 0, 0, 10, token=T1)
    clock.now = 0.9
    assert o.reap() == []
    clock.now = 1.1
    assert o.reap() == [5] and o.expired == 1


LAYOUT = KvLayout("Qwen3MoeForCausalLM", 2, "float32", (("k", (2, 8)), ("v", (2, 8))))


def _handle(**kw) -> KvHandle:
    base = dict(server_id="s", host="127.0.0.1", port=1234, host_id="h", arena="/dev/shm/x", slot=3, transfer_id=9,
                offset_bytes=64, nbytes=512, num_tokens=4, layout=LAYOUT, first_token_id=17,
                first_logprobs={17: (-0.5, 1), 3: (-1.5, 2)}, prompt_logprobs=({1: (-2.0, 1)}, {2: (-0.1, 1)}),
                token=(1 << 63) - 5, weights="0123456789abcdef")
    return KvHandle(**{**base, **kw})


def test_the_handle_survives_json_and_names_what_is_wrong():
    import json

    h = _handle()
    assert KvHandle.from_params(json.loads(json.dumps(h.to_params()))) == h
    assert KvHandle.from_params(json.loads(json.dumps(_handle(staged=False).to_params()))).staged is False
    p = h.to_params()
    with pytest.raises(ValueError, match="kv_transfer_params.remote_port: expected int, got '1234'"):
        KvHandle.from_params({**p, "remote_port": "1234"})
    with pytest.raises(ValueError, match="kv_transfer_params.kv_layout: not a KV layout"):
        KvHandle.from_params({**p, "kv_layout": {"architecture": "x"}})
    with pytest.raises(ValueError, match="first_token_id: expected int, got True"):
        KvHandle.from_params({**p, "first_token_id": True})
    for bad in ("", "x" * 16, "8000000000000000", "1" * 17, "-1"):
        with pytest.raises(ValueError, match="kv_transfer_params.remote_token"):
            KvHandle.from_params({**p, "remote_token": bad})
    placed = _handle(block_ids=(4, 0, 9), group=1, offset_bytes=-1)  # the leased blocks, in place
    assert KvHandle.from_params(json.loads(json.dumps(placed.to_params()))) == placed and placed.in_place
    assert not h.in_place
    for bad in ([1, -2], [1, True], "3", [1.5]):
        with pytest.raises(ValueError, match="kv_transfer_params.remote_block_ids: expected a list of block ids"):
            KvHandle.from_params({**p, "remote_block_ids": bad})
    with pytest.raises(ValueError, match="kv_transfer_params.remote_group: expected an int >= 0"):
        KvHandle.from_params({**p, "remote_group": -1})


def test_a_pull_over_a_gloo_pair_on_loopback():
    arena = KvArena.create(arena_path(f"test-{uuid.uuid4().hex[:8]}"), 1 << 20)
    offers = Offers(lease_s=30.0)
    server = KvServer(arena, offers, "127.0.0.1", 0)
    client = KvClient()
    try:
        data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # [16384] bytes
        arena.heap_view(4096, data.numel()).copy_(data)
        offers.offer(11, slot=0, offset_bytes=4096, nbytes=data.numel(), token=T1)
        forged = RemoteRange("srv", "127.0.0.1", server.port, 11, 0, 4096, data.numel(), T2)
        client.claim(forged, "forged")
        client.release(forged)
        (f,) = _wait(client)
        assert not f.ok and offers.reap() == []  # the wrong token: neither claimed nor freed
        r = RemoteRange("srv", "127.0.0.1", server.port, 11, 0, 4096, data.numel(), T1)
        into = torch.zeros(data.numel(), dtype=torch.uint8)
        client.pull(r, into, "a")
        (a,) = _wait(client)
        assert a.cookie == "a" and a.ok and torch.equal(into, data)
        client.release(r)
        deadline = time.monotonic() + 5
        while offers.reap() != [11]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.claim(r, "b")  # released and reaped: nothing there any more
        (b,) = _wait(client)
        assert not b.ok and "no longer offers transfer 11" in b.error
    finally:
        client.shutdown()
        server.shutdown()
    port = server.port
    again = KvServer(arena, Offers(30.0), "127.0.0.1", port)  # a restarted server binds its port again
    again.shutdown()
    arena.close()


def _wait(client: KvClient, n: int = 1, timeout_s: float = 10.0) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline
        out += client.poll(0.05)
    return out


def _fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


def _kv_threads() -> int:
    import threading
    return sum(t.name.startswith("kv-") for t in threading.enumerate())


def test_the_port_asks_for_the_secret_and_a_silent_or_flooding_peer_delays_nobody():
    """The red-team's flood: 100 bare connections to a prefill server's KV port added 300 threads,
    1,300 descriptors and 200 listening sockets that stayed, and one silent connection delayed the
    next hello by 10 s. Now a hello is read off the accept thread within seconds, pairings are
    bounded, and a decode server without the deployment's secret is refused, saying why."""
    import socket

    from moeflow.comm.kv_link import HELLO_TIMEOUT_S

    arena = KvArena.create(arena_path(f"test-{uuid.uuid4().hex[:8]}"), 1 << 16)
    offers = Offers(lease_s=30.0)
    server = KvServer(arena, offers, "127.0.0.1", 0, secret="s3cret")
    ranges = []
    for tid in range(1, 4):
        offers.offer(tid, tid, 64 * tid, 64, token=T1 + tid)
        ranges.append(RemoteRange("srv", "127.0.0.1", server.port, tid, tid, 64 * tid, 64, T1 + tid))
    clients = [KvClient("wrong"), KvClient(None), KvClient("s3cret"), KvClient("s3cret"), KvClient("s3cret")]
    try:
        for c in clients[:2]:
            c.claim(ranges[0], "x")
            (a,) = _wait(c)
            assert not a.ok and "does not know the KV secret" in a.error, a.error
        silent = socket.create_connection(("127.0.0.1", server.port))
        t0 = time.monotonic()
        for c, r in zip(clients[2:4], ranges):
            c.claim(r, "ok")
            (a,) = _wait(c)
            assert a.ok and time.monotonic() - t0 < 1.5  # not behind the silent one
        fds0, threads0 = _fds(), _kv_threads()  # two live pairs (both ends here), the silent connection
        flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
        time.sleep(0.3)
        print(f"100 bare connections: KV threads {threads0} -> {_kv_threads()}, descriptors {fds0} -> {_fds()}, "
              f"{server.refused} refused at once")
        assert _kv_threads() <= threads0 + MAX_PENDING  # the bound
        assert server.refused >= 100 - MAX_PENDING
        for s in flood:
            s.close()
        silent.settimeout(HELLO_TIMEOUT_S + 2)
        got = b""
        while chunk := silent.recv(256):  # the greeting, then the server hangs up on it
            got += chunk
        assert got.startswith(b"moeflow-kv ") and time.monotonic() - t0 < HELLO_TIMEOUT_S + 2
        silent.close()
        deadline = time.monotonic() + 5
        while _kv_threads() > threads0 - 1 or _fds() > fds0 - 1:  # all of it back, the silent one's too
            assert time.monotonic() < deadline, (_kv_threads(), threads0, _fds(), fds0)
            time.sleep(0.1)
        print(f"after the flood: KV threads {_kv_threads()}, descriptors {_fds()} (silent one answered at "
              f"{time.monotonic() - t0:.1f} s)")
        clients[4].claim(ranges[2], "again")  # the port still pairs
        (a,) = _wait(clients[4])
        assert a.ok
    finally:
        for c in clients:
            c.shutdown()
        server.shutdown()
        arena.close()
