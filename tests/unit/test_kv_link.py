"""The KV link's pieces: the prefill side's offers (leases, claims, releases, a reader that dies),
the handle's JSON form and its validation, and a real pull over a gloo pair on loopback (bytes
equal, a released range answers GONE, the bootstrap port is bound again after a shutdown)."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from moeflow.comm.kv_arena import KvArena, arena_path
from moeflow.comm.kv_client import KvClient, RemoteRange
from moeflow.comm.kv_server import KvServer, Offers
from moeflow.kv_handle import KvHandle, KvLayout


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_offers_lease_claim_release_and_a_dead_reader():
    clock = Clock()
    o = Offers(lease_s=10.0, clock=clock)
    o.offer(1, slot=0, offset_bytes=0, nbytes=100)
    o.offer(2, slot=1, offset_bytes=128, nbytes=100)
    o.offer(3, slot=2, offset_bytes=256, nbytes=100)
    assert not o.claim(1, slot=0, offset_bytes=64, nbytes=100, pair=7)  # other bytes than offered
    assert not o.claim(1, slot=0, offset_bytes=0, nbytes=101, pair=7)
    assert o.claim(1, 0, 0, 100, pair=7) and o.claim(1, 0, 0, 100, pair=7)  # the same reader may ask again
    assert not o.claim(1, 0, 0, 100, pair=8)  # another one may not
    assert o.claim(2, 1, 128, 100, pair=8)
    clock.now = 5.0
    assert o.reap() == []
    o.release(3)
    assert o.reap() == [3] and o.expired == 0  # released: freed, not counted as expired
    o.pair_gone(8)
    assert o.reap() == [2] and o.expired == 1  # its reader died mid-read
    clock.now = 10.5  # claimed at 0: the claim gave one more lease from then
    assert o.reap() == [1] and o.expired == 2
    assert not o.claim(1, 0, 0, 100, pair=7) and len(o) == 0


def test_an_unclaimed_offer_expires_with_its_lease():
    clock = Clock()
    o = Offers(lease_s=1.0, clock=clock)
    o.offer(5, 0, 0, 10)
    clock.now = 0.9
    assert o.reap() == []
    clock.now = 1.1
    assert o.reap() == [5] and o.expired == 1


LAYOUT = KvLayout("Qwen3MoeForCausalLM", 2, "float32", (("k", (2, 8)), ("v", (2, 8))))


def _handle(**kw) -> KvHandle:
    base = dict(server_id="s", host="127.0.0.1", port=1234, host_id="h", arena="/dev/shm/x", slot=3, transfer_id=9,
                offset_bytes=64, nbytes=512, num_tokens=4, layout=LAYOUT, first_token_id=17,
                first_logprobs={17: (-0.5, 1), 3: (-1.5, 2)}, prompt_logprobs=({1: (-2.0, 1)}, {2: (-0.1, 1)}))
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


def test_a_pull_over_a_gloo_pair_on_loopback():
    arena = KvArena.create(arena_path(f"test-{uuid.uuid4().hex[:8]}"), 1 << 20)
    offers = Offers(lease_s=30.0)
    server = KvServer(arena, offers, "127.0.0.1", 0)
    client = KvClient()
    try:
        data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # [16384] bytes
        arena.heap_view(4096, data.numel()).copy_(data)
        offers.offer(11, slot=0, offset_bytes=4096, nbytes=data.numel())
        r = RemoteRange("srv", "127.0.0.1", server.port, 11, 0, 4096, data.numel())
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
