"""KV blocks on demand, and preemption by recompute, in the shared scheduler (every mode's): a
request is admitted once its known tokens fit, takes a block when it crosses one, and when a
group runs out its most recently admitted request that is not on the workers goes back to the
head of the waiting queue, pinned to its group, with its tokens so far; the old whole-life
reservation stays as ``reserve``."""
from __future__ import annotations

import pytest

from moeflow.config import EngineConfig
from moeflow.core import Request, RequestStatus, SamplingParams
from moeflow.layout import make_layout
from moeflow.scheduler import make_scheduler
from moeflow.scheduler.pool import resident_capacity


def _req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _sched(mode: str = "colocated", blocks: int = 8, admission: str = "on-demand", **layout):
    cfg = EngineConfig(num_kv_blocks=blocks, kv_block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                       kv_admission=admission)
    return make_scheduler(make_layout(mode, **layout), cfg, 4096)


def _step(s, token: int = 7) -> list:
    """Schedule and apply one step; every piece that ends its known tokens samples ``token``."""
    works = s.schedule(0.0)
    finished = []
    for w in works:
        for b in w.batches:
            finished += s.update(w.group, b, {q.request_id: token for q in b.seqs if q.is_last_chunk})
        s.release(w.group)
    return works


def test_admission_needs_only_the_known_tokens_and_blocks_grow_with_the_sequence():
    s, reserve = _sched(blocks=8), _sched(blocks=8, admission="reserve")
    for sched in (s, reserve):  # 24 tokens each: 6 of the 8 blocks for a whole life
        for i in range(2):
            sched.add(_req(f"l{i}", 4, 20))
        _step(sched)
    a = s.pool.groups[0].allocator
    assert len(s.pool.groups[0].requests) == 2 and a.num_free == 6  # one block each so far
    assert len(reserve.pool.groups[0].requests) == 1  # the second waits for the first's whole life
    for _ in range(4):  # the 5th token of each crosses into a second block, taken then
        _step(s)
    assert [len(a.table(f"l{i}")) for i in range(2)] == [2, 2] and a.num_free == 4
    with pytest.raises(Exception, match="needs 9 KV blocks, the cache has 8"):  # never fits: refused at once
        s.add(_req("x", 4, 32))


def test_a_group_out_of_blocks_preempts_its_newest_request_by_recompute():
    s = _sched(blocks=4)
    old, new = _req("old", 6, 10), _req("new", 6, 10)  # 2 blocks each at admission: the cache is full
    s.add(old)
    s.add(new)
    _step(s)
    for _ in range(2):  # tokens 7 and 8 fit the second block; the 9th does not
        _step(s)
    assert s.pool.num_preemptions == 0 and len(old.output_token_ids) == 3
    _step(s)  # old needs a third block: new (the newest, not on the workers) is preempted
    pool = s.pool
    assert pool.num_preemptions == 1 and new.status is RequestStatus.WAITING and pool.waiting[0] is new
    assert new.num_computed_tokens == 0 and len(new.output_token_ids) == 3 and pool.pinned["new"] == 0
    assert len(pool.groups[0].allocator.table("old")) == 3 and len(old.output_token_ids) == 4
    while old.status is not RequestStatus.FINISHED:  # new comes back once old is done (FCFS)
        _step(s)
    works = _step(s)
    (seq,) = works[0].batches[0].seqs  # the recompute: prompt and its 3 tokens, then a 4th is sampled
    assert (seq.request_id, seq.start, seq.num_tokens, seq.is_last_chunk) == ("new", 0, 9, True)
    assert len(new.output_token_ids) == 4 and "new" not in pool.pinned


def test_a_request_on_the_workers_is_never_preempted():
    """With a step still out (afd's overlap scheduling schedules the next one meanwhile), its
    requests keep their blocks; the request that needs room goes back itself."""
    s = _sched(blocks=4)
    old, new = _req("old", 6, 10), _req("new", 6, 10)
    for r in (old, new):
        s.add(r)
    _step(s)
    pool = s.pool
    pool.seq(new, 1)  # new's next token is being computed
    assert not pool.make_room(old, 9)  # old needs a third block; the only newer one is on the workers
    assert old.status is RequestStatus.WAITING and pool.pinned["old"] == 0 and pool.waiting[0] is old
    assert new.status is RequestStatus.RUNNING and len(pool.groups[0].allocator.table("new")) == 2


def test_a_preempted_request_goes_back_to_its_own_group():
    s = _sched("dep", blocks=4, dp=2, max_batch_tokens=64)
    reqs = [_req(f"r{i}", 6, 10) for i in range(4)]  # two per rank, each rank's cache full
    for r in reqs:
        s.add(r)
    for _ in range(4):
        _step(s)
    pool = s.pool
    assert pool.num_preemptions == 2 and set(pool.pinned.values()) == {0, 1}
    pinned = dict(pool.pinned)
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        for w in s.schedule(0.0):
            for b in w.batches:
                for q in b.seqs:
                    if q.request_id in pinned:
                        assert w.group == pinned[q.request_id]
                s.update(w.group, b, {q.request_id: 7 for q in b.seqs if q.is_last_chunk})
    assert all(len(r.output_token_ids) == 10 for r in reqs) and not pool.pinned and not pool.in_flight


def test_resident_capacity_is_what_both_admissions_hold_once_grown():
    assert resident_capacity(num_blocks=100, block_size=16, tokens=160, max_num_seqs=64) == 10
    assert resident_capacity(num_blocks=100, block_size=16, tokens=161, max_num_seqs=64) == 9
    assert resident_capacity(num_blocks=100, block_size=16, tokens=16, max_num_seqs=64) == 64


def _samples(rid: str, prompt: int, n: int, max_tokens: int = 4) -> list[Request]:
    out = []
    for i in range(n):
        r = _req(f"{i}_{rid}", prompt, max_tokens)
        r.prefix_of = out[0].request_id if out else None
        out.append(r)
    return out


@pytest.mark.parametrize("mode, layout", [("colocated", {}), ("dep", {"dp": 2}), ("afd", {"attn_workers": 2})])
def test_later_samples_share_the_first_samples_full_prompt_blocks(mode, layout):
    s = _sched(mode, blocks=16, **layout)
    first, *rest = fam = _samples("p", 11, 3)  # blocks of 4: positions 0..7 shared, 8..10 each its own
    for r in fam:
        s.add(r)
    assert list(s.pool.held) == [first.request_id]
    works = _step(s)
    assert {q.request_id for w in works for b in w.batches for q in b.seqs} == {first.request_id}
    g = s.pool.group_of[first.request_id]
    a = s.pool.groups[g].allocator
    works = _step(s)  # the samples join, with only the rest of the prompt to compute
    pieces = {q.request_id: q for w in works for b in w.batches for q in b.seqs}
    for r in rest:
        assert s.pool.group_of[r.request_id] == g
        assert (pieces[r.request_id].start, pieces[r.request_id].num_tokens) == (8, 3)
        assert a.table(r.request_id)[:2] == a.table(first.request_id)[:2]
        assert a.table(r.request_id)[2] != a.table(first.request_id)[2]
    assert a.num_free == 16 - 3 - 2  # the first's 3 blocks, one own block per later sample
    while s.has_unfinished():
        _step(s)
    assert a.num_free == 16  # shared blocks return once their last holder frees them


def test_samples_compute_the_prompt_themselves_when_the_first_is_gone():
    s = _sched(blocks=16)
    first, second = _samples("p", 11, 2, max_tokens=1)
    s.add(first)
    s.add(second)
    s.abort(first.request_id, "abort")
    assert not s.pool.held and list(s.pool.waiting) == [second]
    _step(s)
    assert second.num_computed_tokens == 11
    # aborted while held, and while waiting with shared blocks: nothing leaks
    s = _sched(blocks=16)
    fam = _samples("q", 11, 3, max_tokens=6)
    for r in fam:
        s.add(r)
    s.abort(fam[2].request_id, "abort")
    _step(s)
    s.abort(fam[1].request_id, "abort")  # waiting, holding the two shared blocks
    s.abort(fam[0].request_id, "abort")
    assert s.pool.groups[0].allocator.num_free == 16 and not s.has_unfinished()


@pytest.mark.parametrize("mode,layout", [("dep", {"dp": 1, "max_batch_tokens": 7}),
                                         ("afd", {"attn_workers": 1, "ffn_workers": 1, "max_batch_tokens": 7})])
def test_a_preempted_request_longer_than_a_batch_comes_back_in_chunks(mode, layout):
    """Its recompute (prompt and tokens so far) may exceed max_batch_tokens though its prompt did not: without
    chunked prefill it would wait at the head of the queue forever (found in the simulator: a pd decode
    instance, its caches full, left 1671 requests waiting with every block free)."""
    s = _sched(mode, blocks=4, **layout)
    old, new = _req("old", 6, 10), _req("new", 6, 10)
    s.add(old)
    s.add(new)
    while s.pool.num_preemptions == 0:
        _step(s)
    assert new.status is RequestStatus.WAITING and new.num_tokens > 7  # its prompt, 6, fitted a batch
    while old.status is not RequestStatus.FINISHED:
        _step(s)
    pieces = []
    while new.status is not RequestStatus.FINISHED:
        works = _step(s)
        assert works, "the preempted request is never scheduled again"
        pieces += [(q.start, q.num_tokens) for w in works for b in w.batches for q in b.seqs if q.request_id == "new"]
    assert pieces[0] == (0, 7) and pieces[1][0] == 7 and len(new.output_token_ids) == 10
