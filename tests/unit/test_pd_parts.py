"""The pd layout, the staging arena's copies against their oracle, its heap, and the decode side's
pre-allocation on the pool's ints."""
from __future__ import annotations

import os

import pytest
import torch

from moeflow.comm.kv_arena import HeapRanges, KvArena, head_range, stage_in, stage_out, stage_out_reference
from moeflow.config import ConfigError
from moeflow.core import Request, SamplingParams
from moeflow.layout import layout_from_dict, layout_to_dict, make_layout, parse_parts
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.handoff import Arrivals
from moeflow.scheduler.pool import RequestPool


def test_pd_layout_from_parts_and_back():
    lay = make_layout("pd", prefill=parse_parts("mode=asap,attn_dp=1,moe_workers=1", "--prefill"),
                      decode=parse_parts("mode=afd,attn_workers=1,ffn_workers=1,micro_batches=2", "--decode"),
                      decode_instances=2)
    assert lay.prefill.mode == "asap" and lay.decode.micro_batches == 2 and lay.num_processes == 2 + 2 * 2
    assert layout_from_dict(layout_to_dict(lay)) == lay


@pytest.mark.parametrize("kw,message", [
    (dict(prefill={"mode": "afd"}, decode={"mode": "dep"}), "prefill mode must be one of"),
    (dict(prefill={"mode": "asap"}), "decode must be a layout"),
    (dict(prefill={"mode": "asap", "attn_dpp": 2}, decode={"mode": "dep"}), "unknown keys in pd prefill"),
    (dict(prefill={"mode": "dep"}, decode={"mode": "dep"}, kv_load_failure_policy="retry"), "kv_load_failure_policy"),
    (dict(prefill={"mode": "dep"}, decode={"mode": "dep"}, prefill_instances=0), "prefill_instances"),
])
def test_pd_layout_refuses(kw, message):
    with pytest.raises(ConfigError, match=message):
        make_layout("pd", **kw)


def test_parse_parts_refuses_what_it_cannot_read():
    with pytest.raises(ConfigError, match="key=value"):
        parse_parts("mode=asap,attn_dp", "--prefill")
    with pytest.raises(ConfigError, match="name the mode"):
        parse_parts("attn_dp=2", "--decode")
    assert parse_parts("mode=dep, dp=2, chunked-prefill-size=16", "x") == {"mode": "dep", "dp": 2,
                                                                            "chunked_prefill_size": 16}


def test_head_range():
    assert head_range((4, 8), (4, 8), 1) is None  # whole: replicated
    assert head_range((4, 8), (2, 8), 1) == (2, 4)
    with pytest.raises(ValueError, match="even head split"):
        head_range((4, 8), (3, 8), 0)


@pytest.mark.parametrize("members", [1, 2])
def test_stage_out_and_in_against_the_oracle(tmp_path, members):
    """Every member's heads (and member 0's replicated entries) land where the oracle puts them; the
    decode side, split differently, reads back exactly the prompt's slots."""
    g = torch.Generator().manual_seed(0)
    L, N, H, D, n = 3, 40, 4, 8, 13
    whole = {"k": torch.randn(L, N, H, D, generator=g), "latent": torch.randn(L, N, 6, generator=g)}
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23, 30, 31, 32, 0, 1])  # partial last block included
    arena = KvArena.create(f"/dev/shm/moeflow-test{members}-{id(tmp_path)}.kv-arena", 1 << 16)
    try:
        staged = arena.views(64, L, n, torch.float32, (("k", (H, D)), ("latent", (6,))))
        oracle = {k: torch.zeros_like(v) for k, v in staged.items()}
        for m in range(members):
            h = H // members
            mine = {"k": whole["k"][:, :, m * h:(m + 1) * h].contiguous(), "latent": whole["latent"]}
            stage_out(mine, slots, staged, m)
            stage_out_reference(mine, slots.tolist(), oracle, m)
        for k in staged:
            assert torch.equal(staged[k], oracle[k])
            assert torch.equal(staged[k], whole[k][:, slots])
        dest = {"k": torch.zeros(L, N, H, D), "latent": torch.zeros(L, N, 6)}
        dslots = torch.arange(16, 16 + n)
        stage_in(staged, dest, dslots, 0)
        for k in dest:
            assert torch.equal(dest[k][:, dslots], whole[k][:, slots])
    finally:
        arena.close()


def test_a_member_sees_the_owners_heap_and_flags_and_a_bad_heap_device_is_named(tmp_path):
    """Attached by path, the arena's flags and host heap are the owner's bytes; a heap shared by
    handle (a device heap; here its rehearsal in host memory) serves the same views, outside the
    segment, and the owner's process attaching it gets the owner's tensor; an unknown device is refused."""
    path = f"/dev/shm/moeflow-test-{id(tmp_path)}.kv-arena"
    owner = KvArena.create(path, 1 << 12)
    member = KvArena.attach(path)
    other = KvArena.create(path + "2", 1 << 10, by_handle=True)
    again = KvArena.attach(path + "2")
    try:
        assert member.heap_bytes == owner.heap_bytes == 1 << 12
        member.heap_view(128, 8).copy_(torch.arange(8, dtype=torch.uint8))
        member.flags[3, 1, 2] = 7
        assert owner.heap_view(128, 8).tolist() == list(range(8)) and int(owner.flags[3, 1, 2]) == 7
        v = other.views(64, 2, 3, torch.float32, (("k", (4,)), ("v", (4,))))
        assert v["k"].shape == (2, 3, 4) and v["v"].data_ptr() - v["k"].data_ptr() == 128  # 96 B, aligned to 64
        assert other.heap_bytes == 1 << 10 and owner.heap_view(0, 4).data_ptr() != other.heap_view(0, 4).data_ptr()
        assert again.heap.data_ptr() == other.heap.data_ptr()  # the owner's process: its tensor, not a second map
        assert os.path.getsize(path + "2") == os.path.getsize(path) - (1 << 12)  # the heap is not in the segment
    finally:
        for a in (again, other, member, owner):
            a.close()
    with pytest.raises(ValueError, match="host shared memory or on a CUDA device, got 'meta'"):
        KvArena.create(path, 1 << 12, device="meta")


def test_heap_ranges_first_fit():
    h = HeapRanges(1024)
    a, b = h.take(100), h.take(200)
    assert (a, b) == (0, 128) and h.take(800) is None
    h.give(a)
    assert h.take(64) == 0 and h.used_bytes == 64 + 256


def test_arrivals_reserve_arrive_cancel():
    pool = RequestPool([BlockAllocator(10, 4), BlockAllocator(10, 4)], 100, 8)
    arr = Arrivals(pool)
    r = Request("a", list(range(9)), SamplingParams(max_tokens=5), output_token_ids=[3])
    pool.groups[0].allocator.allocate("x", 8)  # group 1 has more free blocks
    gid = arr.best_group(r)
    assert gid == 1 and len(arr.reserve(gid, r)) == 3  # 10 known tokens, on demand
    assert not pool.groups[1].requests  # invisible to the schedulers until its KV arrived
    assert arr.arrive(r) == 1 and pool.groups[1].requests == [r] and r.num_computed_tokens == 9
    s = Request("b", list(range(9)), SamplingParams(max_tokens=5), output_token_ids=[3])
    arr.reserve(arr.best_group(s), s)
    arr.cancel("b")
    assert pool.groups[1].allocator.num_free == 7 and pool.groups[0].allocator.num_free == 8


def test_pool_leases_blocks_of_a_finished_handoff():
    pool = RequestPool([BlockAllocator(4, 4)], 100, 8)
    r = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), kv_handoff=True)
    pool.enqueue(r)
    pool.admit(0, r)
    batch = type("B", (), {"seqs": (pool.seq(r, 5),)})()
    assert pool.update(0, batch, {"a": 9}) == [r]
    assert pool.leases == {"a": 0} and pool.groups[0].allocator.num_free == 2
    pool.end_lease("a")
    assert not pool.leases and pool.groups[0].allocator.num_free == 4


def test_kv_copies_are_taken_early_but_never_past_a_kept_message():
    """Between layers a worker copies the KV messages already in its pipe; anything else is kept for
    its control loop, and a KV message behind a kept one waits its turn (the pipe's order holds)."""
    from collections import deque

    from moeflow.messages import DumpSpans, KvRecv, KvSend, KvStage
    from moeflow.workers.attention import EarlyKv

    class Pipe:
        def __init__(self, msgs):
            self.msgs = deque(msgs)

        def poll(self, timeout=0.0):
            return bool(self.msgs)

        def recv(self):
            return self.msgs.popleft()

    st = KvStage("/dev/shm/x", 0, 1, 0, 4, 2, "float32", (("k", (2, 8)),))
    a, b, c = KvSend(st, (1,)), KvRecv(st, (2,)), KvSend(st, (3,))
    copied = []
    pipe = EarlyKv(Pipe([a, b, "run-work", c]), copied.append)
    pipe.copy_waiting()
    assert copied == [a, b] and [pipe.recv(), pipe.recv()] == ["run-work", c] and not pipe.poll()
    spans = DumpSpans()
    pipe = EarlyKv(Pipe([spans, a]), copied.append)
    pipe.copy_waiting()
    assert copied == [a, b] and pipe.poll() and [pipe.recv(), pipe.recv()] == [spans, a]
