"""BlockAllocator and ContinuousBatching: pure-Python bookkeeping, no model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from moeflow.core import Request, RequestError, RequestStatus, SamplingParams
from moeflow.scheduler.block_allocator import BlockAllocator, OutOfBlocks
from moeflow.scheduler.continuous import ContinuousBatching
from moeflow.scheduler.pool import RequestPool


# -- BlockAllocator --------------------------------------------------------------------------------

def test_allocator_accounting():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert a.num_free == 6 and a.blocks_for(0) == 0 and a.blocks_for(1) == 1 and a.blocks_for(8) == 2
    assert a.allocate("x", 5) == (0, 1)  # low ids first
    assert a.allocate("y", 4) == (2,)
    assert a.num_free == 3
    assert a.allocate("x", 9) == (0, 1, 3)  # grows the existing table
    assert a.allocate("x", 2) == (0, 1, 3)  # never shrinks
    assert a.num_free == 2 and a.table("x") == (0, 1, 3) and a.table("nobody") == ()
    assert a.can_allocate(8) and not a.can_allocate(9)
    with pytest.raises(OutOfBlocks, match="needs 3 more KV blocks, 2 free"):
        a.allocate("z", 12)
    assert a.num_free == 2 and a.table("z") == ()  # a failed allocation takes nothing
    a.free("x")
    assert a.num_free == 5 and a.table("x") == ()
    a.free("x")  # freeing twice is harmless
    assert a.num_free == 5
    a.free("y")
    assert a.num_free == 6
    assert sorted(a.allocate("w", 24)) == list(range(6))  # every block came back exactly once


# -- ContinuousBatching ----------------------------------------------------------------------------

def _req(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class _Sched(ContinuousBatching):
    """The pool's one allocator and waiting queue in reach of the assertions."""

    allocator = property(lambda self: self.pool.groups[0].allocator)
    waiting = property(lambda self: self.pool.waiting)

    def next(self):
        """The batch of the next step, or None when there is nothing to run."""
        works = self.schedule(0.0)
        assert len(works) <= 1 and all(w.group == 0 and len(w.batches) == 1 for w in works)
        return works[0].batches[0] if works else None


def _sched(num_blocks=16, block_size=4, budget=10, max_seqs=4, max_model_len=64, admission="on-demand") -> _Sched:
    return _Sched(RequestPool([BlockAllocator(num_blocks, block_size)], max_model_len, max_seqs, admission), budget)


def _run(s: ContinuousBatching, batch, token: int = 7):
    """Pretend the batch ran: every sequence that reached its end samples ``token``."""
    return s.update(0, batch, {q.request_id: token for q in batch.seqs if q.is_last_chunk})


def _shape(batch) -> list[tuple[str, int, int, bool]]:
    return [(q.request_id, q.start, q.num_tokens, q.is_last_chunk) for q in batch.seqs]


def test_allocator_hands_out_blocks_as_one_pop_at_a_time_would():
    """Oracle: the allocation spelled out, one ``pop`` per block, a new tuple each time (the fast path
    takes a slice and hands out the same tuple again while a table has not grown); tables shared,
    freed and taken again in between."""
    import random

    class OnePopAtATime(BlockAllocator):
        def allocate(self, request_id, num_tokens):
            table = self._tables.setdefault(request_id, [])
            need = self.blocks_for(num_tokens) - len(table)
            if need > len(self._free):
                raise OutOfBlocks(request_id)
            table.extend(self._free.pop() for _ in range(max(need, 0)))
            return tuple(table)

    rng = random.Random(0)
    fast, slow = BlockAllocator(100, 4), OnePopAtATime(100, 4)
    for _ in range(2000):
        rid = f"r{rng.randrange(10)}"
        if rng.random() < 0.3:
            fast.free(rid), slow.free(rid)
            continue
        src = f"r{rng.randrange(10)}"
        if rng.random() < 0.1 and src != rid and not fast.num_held(rid) and fast.num_held(src):
            k = rng.randrange(1, fast.num_held(src) + 1)
            assert fast.share(src, rid, k) == slow.share(src, rid, k)
            continue
        n = rng.randrange(60)
        got = []
        for a in (fast, slow):
            try:
                got.append(a.allocate(rid, n))
            except OutOfBlocks:
                got.append(OutOfBlocks)
        assert got[0] == got[1] and fast.num_free == slow.num_free and fast.table(rid) == slow.table(rid)


def test_long_prompt_is_chunked_by_token_budget():
    s = _sched(budget=10)
    r = _req("a", 25, max_tokens=3)
    s.add(r)
    b = s.next()
    assert _shape(b) == [("a", 0, 10, False)]
    assert r.status is RequestStatus.RUNNING
    assert s.allocator.table("a") == (0, 1, 2, 3, 4, 5, 6)  # blocks for prompt + max_tokens = 28 up front
    assert b.seqs[0].block_ids == (0, 1, 2, 3, 4, 5, 6)
    assert _run(s, b) == [] and r.num_computed_tokens == 10 and r.output_token_ids == []
    b = s.next()
    assert _shape(b) == [("a", 10, 10, False)]
    _run(s, b)
    b = s.next()
    assert _shape(b) == [("a", 20, 5, True)]  # last chunk: a token is sampled
    _run(s, b)
    assert r.output_token_ids == [7] and not r.is_prefill
    assert _shape(s.next()) == [("a", 25, 1, True)]  # then one token per step


def test_running_first_then_fifo_admission_within_budget():
    s = _sched(budget=10, max_seqs=3)
    for rid, n in (("a", 6), ("b", 3), ("c", 2), ("d", 1)):
        s.add(_req(rid, n))
    b = s.next()
    assert _shape(b) == [("a", 0, 6, True), ("b", 0, 3, True), ("c", 0, 1, False)]  # budget 10 split
    _run(s, b)
    b = s.next()
    # running requests (decodes, then c's remaining prompt token) go first; d waits: max_num_seqs=3
    assert _shape(b) == [("a", 6, 1, True), ("b", 3, 1, True), ("c", 1, 1, True)]
    assert [r.request_id for r in s.waiting] == ["d"]
    assert b.num_tokens == 3


def test_whole_life_reservation_frees_blocks_and_admits_the_next():
    """kv_admission reserve (the policy before on-demand, kept for before/after runs)."""
    s = _sched(num_blocks=4, block_size=4, budget=32, admission="reserve")
    a, big, small = _req("a", 7, max_tokens=2), _req("big", 9, max_tokens=3), _req("small", 1, max_tokens=1)
    for r in (a, big, small):
        s.add(r)
    b = s.next()
    # a takes 3 blocks; big (3 blocks) does not fit in the 1 left, and small may not overtake it
    assert _shape(b) == [("a", 0, 7, True)]
    assert s.allocator.num_free == 1 and [r.request_id for r in s.waiting] == ["big", "small"]
    assert _run(s, b) == []
    b = s.next()
    assert _shape(b) == [("a", 7, 1, True)]
    finished = _run(s, b)
    assert finished == [a] and a.finish_reason == "length" and a.status is RequestStatus.FINISHED
    assert s.allocator.num_free == 4 and s.allocator.table("a") == ()
    b = s.next()
    assert _shape(b) == [("big", 0, 9, True), ("small", 0, 1, True)]  # 3 + 1 blocks: both fit now
    assert s.allocator.num_free == 0


def test_stop_token_finishes_early():
    s = _sched()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    s.add(r)
    assert _run(s, s.next(), token=7) == [r]
    assert r.finish_reason == "stop" and r.stop_reason == 7 and not s.has_unfinished()
    assert s.allocator.num_free == 16


def test_eos_respected_unless_ignored():
    s = _sched()
    r = Request("a", [1], SamplingParams(max_tokens=10), eos_token_ids=(9,))
    r2 = Request("b", [1], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=(9,))
    s.add(r)
    s.add(r2)
    assert _run(s, s.next(), token=9) == [r]
    assert r.finish_reason == "stop" and r.stop_reason is None and r2.finish_reason is None


def test_too_long_requests_are_rejected_with_the_numbers():
    s = _sched(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(RequestError) as e:
        s.add(_req("long", 18, max_tokens=5))
    msg = str(e.value)
    assert "long" in msg and "18" in msg and "5" in msg and "23" in msg and "20" in msg
    with pytest.raises(RequestError, match="needs 5 KV blocks, the cache has 4"):
        s.add(_req("wide", 17, max_tokens=2))  # fits the context, not the whole cache
    with pytest.raises(RequestError, match="empty"):
        s.add(_req("empty", 0))
    assert not s.has_unfinished() and s.next() is None
    s.add(_req("ok", 15, max_tokens=1))  # exactly 16 tokens = 4 blocks, within 20
    assert s.next() is not None


def test_abort_waiting_and_running():
    s = _sched(budget=4, max_seqs=1)
    a, b = _req("a", 6), _req("b", 2)
    s.add(a)
    s.add(b)
    batch = s.next()  # a's first chunk runs; b waits (max_num_seqs=1)
    assert s.abort("b", "abort") is b and b.finish_reason == "abort" and list(s.waiting) == []
    assert s.abort("a", "abort") is a and s.allocator.num_free == 16
    assert _run(s, batch) == []  # the in-flight batch of an aborted request is ignored
    assert s.abort("nobody", "abort") is None
    assert not s.has_unfinished() and s.next() is None


def test_scheduler_and_core_do_not_import_torch():
    code = ("import sys, moeflow.scheduler.continuous, moeflow.scheduler.eplb, moeflow.core, moeflow.config; "
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
