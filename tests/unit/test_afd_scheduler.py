"""AFD's scheduler on ints: m micro-batches per instance on request boundaries, balanced; overlap
scheduling continues requests from what in-flight steps will have computed and sampled."""
from __future__ import annotations

import pytest

from moeflow.config import ConfigError, EngineConfig
from moeflow.core import Request, SamplingParams
from moeflow.layout import make_layout
from moeflow.scheduler import make_scheduler
from moeflow.scheduler.afd import split_micro_batches


def _req(rid: str, n: int, max_tokens: int = 4, stop: tuple[int, ...] = ()) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop))


def _sched(m: int = 1, ub: int = 2, chunk=None):
    layout = make_layout("afd", attn_workers=m, ffn_workers=1, micro_batches=ub, chunked_prefill_size=chunk,
                         max_batch_tokens=1000)
    return make_scheduler(layout, EngineConfig(num_kv_blocks=1000, kv_block_size=16, max_num_seqs=64), 8192)


def _ids(batch) -> list[str]:
    return [s.request_id for s in batch.seqs]


def test_micro_batches_are_whole_requests_balanced_by_tokens_then_context():
    reqs = [_req(c, 1) for c in "abcd"]
    context = {"a": 4000, "b": 100, "c": 3000, "d": 200}
    ubs = split_micro_batches([(r, 1) for r in reqs], 2, context)
    # longest context first, each to the lighter list: a, c, then d and b: 4100 vs 3200
    assert [[r.request_id for r, _ in ub] for ub in ubs] == [["a", "b"], ["c", "d"]]
    ubs = split_micro_batches([(reqs[0], 300), (reqs[1], 100), (reqs[2], 100), (reqs[3], 100)], 2, context)
    assert [sum(n for _, n in ub) for ub in ubs] == [300, 300]
    assert split_micro_batches([(reqs[0], 5)], 3, context)[1:] == [[], []]  # empty ones stay: every instance sends m


def test_every_live_instance_gets_m_micro_batches_every_step():
    s = _sched(m=3, ub=2)
    s.add(_req("a", 10))
    works = s.schedule(0.0)
    assert [w.group for w in works] == [0, 1, 2] and all(len(w.batches) == 2 for w in works)
    assert sum(b.num_tokens for w in works for b in w.batches) == 10


def test_overlap_scheduling_continues_from_the_steps_in_flight():
    s = _sched(ub=1, chunk=8)
    s.add(_req("a", 12, max_tokens=3))
    (w1,) = s.schedule(0.0)  # chunk [0, 8)
    (w2,) = s.schedule(0.0)  # before w1 returns: chunk [8, 12), the last: it samples
    (w3,) = s.schedule(0.0)  # the token w2 samples, at position 12
    seqs = [w.batches[0].seqs[0] for w in (w1, w2, w3)]
    assert [(x.start, x.num_tokens, x.is_last_chunk) for x in seqs] == [(0, 8, False), (8, 4, True), (12, 1, True)]
    (w4,) = s.schedule(0.0)
    assert w4.batches[0].seqs[0].start == 13
    assert s.schedule(0.0) == []  # three samples in flight = max_tokens: never overrun
    for w, tok in [(w1, None), (w2, 100), (w3, 101)]:
        assert s.update(0, w.batches[0], {} if tok is None else {"a": tok}) == []
    (done,) = s.update(0, w4.batches[0], {"a": 102})
    assert done.output_token_ids == [100, 101, 102] and done.finish_reason == "length"
    assert not s.has_unfinished() and s._ahead == {} and s._samples == {}


def test_a_stop_token_in_flight_drops_the_next_steps_result():
    s = _sched(ub=1)
    s.add(_req("a", 5, max_tokens=10, stop=(7,)))
    (w1,) = s.schedule(0.0)
    (w2,) = s.schedule(0.0)  # speculates that a continues
    (done,) = s.update(0, w1.batches[0], {"a": 7})
    assert done.finish_reason == "stop" and done.output_token_ids == [7]
    assert s.update(0, w2.batches[0], {"a": 9}) == [] and done.output_token_ids == [7]
    assert not s.has_unfinished() and s._ahead == {}


def test_layout_checks():
    with pytest.raises(ConfigError, match="attn_workers .* must be >= ffn_workers"):
        make_layout("afd", attn_workers=1, ffn_workers=2)
    assert make_layout("afd", attn_workers=1, ffn_workers=2, topology="all").ffns_of(0) == (0, 1)
    with pytest.raises(ConfigError, match="micro_batches must be in"):
        make_layout("afd", micro_batches=5)
    layout = make_layout("afd", attn_workers=5, ffn_workers=2)
    assert [layout.served_by(j) for j in range(2)] == [(0, 2, 4), (1, 3)]
    assert layout.num_processes == 7 and layout.num_groups == 5
