"""ASAP scheduling policies on ints: length-aware batching, dual-batch pairing, groups, decode."""
from __future__ import annotations

import pytest

from moeflow.config import SchedulerConfig
from moeflow.core import Request, RequestError, SamplingParams
from moeflow.scheduler.asap import AsapScheduler
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.pool import RequestPool


def _req(rid: str, n: int, t: float = 0.0, max_tokens: int = 1) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=t)


def _sched(groups: int = 1, blocks: int = 1000, **kw) -> AsapScheduler:
    cfg = SchedulerConfig(**{"min_batch_tokens": 100, "max_batch_tokens": 400, "max_batch_wait_s": 1.0,
                             "long_prompt_tokens": 300, **kw})
    return AsapScheduler.from_config(RequestPool([BlockAllocator(blocks, 16) for _ in range(groups)],
                                                 max_model_len=4096, max_num_seqs=64), cfg)


def _ids(work) -> list[list[str]]:
    return [[s.request_id for s in b.seqs] for b in work.batches]


def test_length_aware_waits_for_min_tokens_then_pairs():
    s = _sched()
    s.add(_req("a", 60))
    assert s.schedule(now=0.1) == []  # 60 < 100 tokens and not due
    s.add(_req("b", 50))
    assert s.schedule(now=0.2) == []  # one full batch (110) but no partner yet, not due
    s.add(_req("c", 120))
    (w,) = s.schedule(now=0.3)
    assert _ids(w) == [["a", "b"], ["c"]]


def test_a_lone_batch_goes_when_due():
    s = _sched()
    s.add(_req("a", 60, t=0.0))
    assert s.schedule(now=0.5) == []
    assert s.next_wakeup_s() == pytest.approx(1.0)
    (w,) = s.schedule(now=1.0)
    assert _ids(w) == [["a"]]


def test_long_prompt_runs_alone_and_groups_take_work_in_order():
    s = _sched(groups=2)
    for rid, n in [("long", 350), ("x", 100), ("y", 100)]:
        s.add(_req(rid, n))
    works = s.schedule(now=0.0)
    assert [(w.group, _ids(w)) for w in works] == [(0, [["long"]]), (1, [["x"], ["y"]])]


def test_decode_rides_with_the_next_prefill_and_release_frees_the_group():
    s = _sched(max_batch_wait_s=0.0)
    s.add(_req("a", 120, max_tokens=3))
    (w,) = s.schedule(now=0.0)
    assert s.schedule(now=0.0) == []  # busy group takes nothing
    s.update(0, w.batches[0], {"a": 7})
    s.release(0)
    s.add(_req("b", 120))
    (w2,) = s.schedule(now=0.0)
    assert _ids(w2) == [["a"], ["b"]]
    dec = w2.batches[0].seqs[0]
    assert (dec.start, dec.num_tokens) == (120, 1)


def test_ablations_single_batch_and_immediate():
    s = _sched(dual_batch=False, length_aware=False)
    s.add(_req("a", 10))
    s.add(_req("b", 20))
    (w,) = s.schedule(now=0.0)
    assert _ids(w) == [["a", "b"]]  # immediate: whatever waits, one batch


def test_fifo_respects_kv_capacity_and_rejects_oversized():
    s = _sched(blocks=10)  # 160 tokens of KV per group
    with pytest.raises(RequestError, match="max_batch_tokens"):
        s.add(_req("huge", 500))
    s.add(_req("a", 150, max_tokens=1))
    s.add(_req("b", 150, max_tokens=1))
    (w,) = s.schedule(now=5.0)
    assert _ids(w) == [["a"]]  # b does not fit until a finishes
    s.update(0, w.batches[0], {"a": 1})
    s.release(0)
    (w,) = s.schedule(now=5.0)
    assert _ids(w) == [["b"]]


def test_abort_frees_blocks():
    s = _sched(max_batch_wait_s=0.0)
    s.add(_req("a", 100, max_tokens=5))
    s.schedule(now=0.0)
    free = s.pool.groups[0].allocator.num_free
    assert s.abort("a", "abort").finish_reason == "abort"
    assert s.pool.groups[0].allocator.num_free > free and not s.has_unfinished()


def test_a_lone_batch_is_halved_into_two_interleaved_micro_batches():
    s = _sched(max_batch_wait_s=0.0, min_split_tokens=100)
    s.add(_req("a", 60))
    s.add(_req("b", 90))
    (w,) = s.schedule(now=0.0)
    got = [[(x.request_id, x.start, x.num_tokens, x.is_last_chunk) for x in b.seqs] for b in w.batches]
    assert got == [[("a", 0, 60, True), ("b", 0, 15, False)], [("b", 15, 75, True)]]
    assert [r.request_id for r in s.update(0, w.batches[0], {"a": 1})] == ["a"]  # b's first chunk samples nothing
    assert [r.request_id for r in s.update(0, w.batches[1], {"b": 2})] == ["b"]
    assert s.pool.groups[0].requests == [] and not s.has_unfinished()


def test_no_split_ablation_and_small_batches_stay_whole():
    s = _sched(max_batch_wait_s=0.0, split_lone_batch=False, min_split_tokens=100)
    s.add(_req("a", 150))
    (w,) = s.schedule(now=0.0)
    assert _ids(w) == [["a"]]


def test_a_batch_is_due_exactly_when_next_wakeup_says():
    # 0.7 + 0.1 rounds to 0.7999999999999999, and that minus 0.7 is below 0.1: a timer set
    # for next_wakeup_s must still find the batch due, or the request waits for the next event.
    s = _sched(max_batch_wait_s=0.1)
    s.add(_req("a", 60, t=0.7))
    due = s.next_wakeup_s()
    assert [_ids(w) for w in s.schedule(now=due)] == [[["a"]]]


def _done(s, w) -> None:
    """The work item's results: one token for each of its sequences that reached its end."""
    for b in w.batches:
        s.update(w.group, b, {q.request_id: 7 for q in b.seqs})
    s.release(w.group)


def test_a_group_that_joins_is_scheduled_and_one_that_drains_admits_nothing_new():
    from moeflow.scheduler import groups

    s = _sched(groups=1, max_batch_wait_s=0.0)
    pool = s.pool
    assert groups.add_group(s, 1000, 16) == 1
    s.add(_req("a", 120, max_tokens=4))
    (wa,) = s.schedule(now=1.0)
    s.add(_req("b", 120, max_tokens=4))
    (wb,) = s.schedule(now=1.1)
    assert (wa.group, wb.group, _ids(wb)) == (0, 1, [["b"]])  # the new group takes work while group 0 is busy
    groups.drain(s, 1)
    _done(s, wb)
    s.add(_req("c", 120, max_tokens=4))
    (w,) = s.schedule(now=1.2)
    assert (w.group, _ids(w)) == (1, [["b"]])  # its resident decodes on; c is not admitted there
    _done(s, wa)
    (w0,) = s.schedule(now=1.3)
    assert w0.group == 0 and "c" in str(_ids(w0))
    assert not groups.settled(pool, 1)
    with pytest.raises(ValueError, match=r"groups \[1\] cannot leave: they still hold requests"):
        groups.remove_last(pool, 1)
    _done(s, w)
    s.abort("b", "abort")
    assert groups.settled(pool, 1)
    groups.remove_last(pool, 1)
    assert len(pool.groups) == 1
    with pytest.raises(ValueError, match="none would be left"):
        groups.remove_last(pool, 1)


def test_a_resident_handed_over_keeps_its_positions_in_new_blocks():
    from moeflow.scheduler import groups

    s = _sched(groups=1, max_batch_wait_s=0.0, blocks=20)
    groups.add_group(s, 20, 16)
    s.add(_req("a", 120, max_tokens=4))
    (w,) = s.schedule(now=1.0)
    with pytest.raises(ValueError, match="request a cannot move from group 0 to 1: it is on the workers"):
        groups.hand_over(s, s.pool.get("a"), 1)
    _done(s, w)
    r = s.pool.get("a")
    old, new, n = groups.hand_over(s, r, 1)
    assert n == 120 and len(old) == len(new) == 8 and s.pool.group_of["a"] == 1
    assert s.pool.groups[1].requests == [r] and not s.pool.groups[0].requests
    assert s.pool.groups[0].allocator.num_held("a") == 8  # until the caller has copied them
    groups.release_blocks(s, 0, "a")
    assert s.pool.groups[0].allocator.num_free == 20
    s.add(_req("b", 300, max_tokens=4))  # 19 blocks of group 0's 20: no room for a's 8 there
    for w in s.schedule(now=2.0):
        _done(s, w)
    assert s.pool.group_of["b"] == 0
    assert groups.hand_over(s, r, 0) is None and s.pool.group_of["a"] == 1
