"""The KV handoff's one copy (``comm/kv_pull.py``, ``model/kv_copy.py``): the decode member's pull straight out of the
prefill members' caches, the C++ op and the torch path, against the position-by-position oracle,
for every split of heads the two sides may have."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from moeflow.model.kv_cache import KVCache, carve, slots_for, storage_bytes
from moeflow.comm.kv_pull import copy_by_slices, paired_runs, pull, pull_reference
from moeflow.model.kv_copy import copy_runs, op_runs

L, BS, NB = 3, 4, 24
OP = pytest.mark.skipif(not op_runs(torch.device("cpu")), reason="the KV copy op does not run here (no compiler, "
                        "or MOEFLOW_KV_COPY=torch)")


def _cache(shapes: dict, seed: int, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(L, NB * BS, *s, generator=g).to(dtype) for n, s in shapes.items()}


def _blocks(rng, n_tokens, block_size=BS, nb=NB):
    return tuple(rng.sample(range(nb), -(-n_tokens // block_size)))


def test_paired_runs_pair_every_position_and_merge_what_is_consecutive_on_both_sides():
    rng = random.Random(0)
    for n in (1, 5, 16, 37):
        for sbs, dbs in ((4, 4), (4, 8), (8, 4)):
            sb, db = _blocks(rng, n, sbs, 40), _blocks(rng, n, dbs, 40)
            runs = paired_runs(sb, sbs, db, dbs, n)
            pairs = [(a + k, b + k) for a, b, m in runs for k in range(m)]
            assert pairs == list(zip(slots_for(sb, 0, n, sbs).tolist(), slots_for(db, 0, n, dbs).tolist()))
    assert paired_runs((2, 3, 4), 4, (7, 8, 9), 4, 12) == [(8, 28, 12)]  # consecutive on both: one run


@pytest.mark.parametrize("copy", [pytest.param(copy_runs, marks=OP), copy_by_slices], ids=["op", "torch"])
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_pull_matches_the_oracle_for_every_head_split(copy, src_tp, dst_tp):
    """GQA's K/V split over members by heads; MLA-like whole entries replicated on every member."""
    whole = {"k": (4, 8), "v": (4, 8), "latent": (12,)}
    src = [_cache({"k": (4 // src_tp, 8), "v": (4 // src_tp, 8), "latent": (12,)}, seed=m) for m in range(src_tp)]
    rng = random.Random(src_tp * 10 + dst_tp)
    n = 19
    sb, db = _blocks(rng, n), _blocks(rng, n)
    runs = paired_runs(sb, BS, db, BS, n)
    for member in range(dst_tp):
        shapes = {"k": (4 // dst_tp, 8), "v": (4 // dst_tp, 8), "latent": (12,)}
        got, want = _cache(shapes, seed=99), _cache(shapes, seed=99)
        pull([(s, m) for m, s in enumerate(src)], whole, got, member, runs, copy=copy)
        pull_reference([(s, m) for m, s in enumerate(src)], whole, want, member,
                       slots_for(sb, 0, n, BS).tolist(), slots_for(db, 0, n, BS).tolist())
        for name in whole:
            assert torch.equal(got[name], want[name]), name  # the reserved slots, and nothing else touched


@OP
def test_the_op_copies_head_slices_and_long_runs_as_torch_does():
    """Rows that are not whole (a head slice) go token by token; whole ones as one block per layer,
    past the size where the op streams its stores."""
    for shape, sl in (((4, 64), slice(1, 3)), ((8, 128), slice(None))):
        src, a, b = (torch.randn(2, 256, *shape).to(torch.bfloat16) for _ in range(3))
        b.copy_(a)
        runs = [(0, 100, 40), (200, 7, 33), (50, 180, 1)]
        copy_runs(src[:, :, sl], a[:, :, sl], runs)
        copy_by_slices(src[:, :, sl], b[:, :, sl], runs)
        assert torch.equal(a, b)


@OP
def test_the_op_refuses_a_run_outside_the_cache_naming_it():
    src, dst = torch.zeros(2, 32, 4), torch.zeros(2, 32, 4)
    with pytest.raises(RuntimeError, match=r"run 1 \(30, 0, 4\) is outside"):
        copy_runs(src, dst, [(0, 0, 2), (30, 0, 4)])


def test_a_cache_carved_from_one_buffer_is_laid_out_as_a_mapper_rebuilds_it():
    layout = {"k": (2, 8), "v": (2, 8), "index_k": (16,)}
    storage = torch.zeros(storage_bytes(layout, L, NB * BS, torch.bfloat16), dtype=torch.uint8)
    cache = KVCache(layout, L, NB, BS, torch.bfloat16, storage=storage)
    cache.entries["v"][1, 5] = 3.0
    again = carve(storage, layout, L, NB * BS, torch.bfloat16)  # another process, the same numbers
    assert torch.equal(again["v"], cache.entries["v"]) and float(again["v"][1, 5, 0, 0]) == 3.0
    with pytest.raises(ValueError, match="does not fit"):
        carve(storage[:-64], layout, L, NB * BS, torch.bfloat16)


def test_a_decode_member_reads_a_shared_cache_in_place_and_stores_its_flag():
    """The worker's side (``workers/kv_transfer.py``): a ``KvRecv`` whose stage names the prefill
    member's cache is one copy out of it, then the flag in a flags-only arena (no heap)."""
    import os
    import uuid

    from moeflow.comm.kv_arena import READ
    from moeflow.comm.segment import cleanup, segment_path
    from moeflow.engine.kv_handoff import DONE, KvConnector
    from moeflow.messages import KvRecv, KvSource
    from moeflow.workers.kv_transfer import KvTransfers, shared_cache_of

    run = f"{os.getpid()}-kvcopy{uuid.uuid4().hex[:6]}"
    layout = {"k": (2, 8), "v": (2, 8)}
    src, region, src_mem = shared_cache_of(layout, L, NB, BS, torch.float32, "cpu", segment_path(run, "a"), 0)
    dst, _, dst_mem = shared_cache_of(layout, L, NB, BS, torch.float32, "cpu", segment_path(run, "b"), 0)
    conn = KvConnector(run, 0, L, "float32", tuple(layout.items()))
    kv = KvTransfers(dst, 0)
    try:
        for t in src.entries.values():
            t.copy_(torch.randn(t.shape))
        assert not conn.staged and conn.arena.heap_bytes == 0
        n, sb, db = 10, (5, 2, 9), (0, 1, 17)
        stage = conn.open(n)
        kv.handle(KvRecv(dataclasses.replace(stage, source=KvSource((region,), sb)), db))
        assert conn.status(stage, READ, 1) == DONE
        ss, ds = slots_for(sb, 0, n, BS), slots_for(db, 0, n, BS)
        for name in layout:
            assert torch.equal(dst.entries[name][:, ds], src.entries[name][:, ss])
    finally:
        kv.close()
        conn.shutdown()
        src_mem.close()
        dst_mem.close()
        assert cleanup(run) == []  # the owners unlinked their caches


def test_a_prefill_servers_table_of_caches_is_read_back_and_only_from_our_own_segments(tmp_path):
    """``engine/kv_regions.py``: the table a decode server on the host reads; republished when a
    worker's cache changes (the name stays); a path from a handle outside /dev/shm/moeflow-* is not read."""
    import os
    import uuid

    from moeflow.comm.kv_arena import arena_path
    from moeflow.engine.kv_regions import RegionTable, read_regions
    from moeflow.messages import KvRegion

    arena = arena_path(f"{os.getpid()}-regions{uuid.uuid4().hex[:6]}")
    r0 = KvRegion(b"handle-a", L, NB * BS, BS, "float32", (("k", (2, 8)),), 0)
    table = RegionTable(arena)
    try:
        table.publish({0: (r0,), 1: (r0,)})
        assert read_regions(arena, 0) == (r0,) and read_regions(arena, 5) is None
        r1 = dataclasses.replace(r0, handle=b"handle-b")
        table.publish({0: (r1,), 1: (r0,)})  # a restarted worker's new cache
        assert read_regions(arena, 0) == (r1,) and os.path.exists(table.path)
        foreign = tmp_path / "x.kv-arena"
        (tmp_path / "x.kv-regions").write_bytes(b"\0" * 16)
        assert read_regions(str(foreign), 0) is None
    finally:
        table.close()
    assert not os.path.exists(table.path) and read_regions(arena, 0) is None
