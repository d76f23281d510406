"""Mode pd against the colocated reference: prefill instances of one mode hand each request's KV
(GQA K/V split over TP members or whole, MLA's latent rows, DSA's indexer keys) to decode
instances of another; greedy outputs and prompt logprobs equal colocated's, the decode side never
recomputed a prompt, and every block is back where it came from."""
from __future__ import annotations

import pytest

from moeflow import LLM
from moeflow.comm import list_segments

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs

ASAP = {"mode": "asap", "attn_dp": 1, "moe_workers": 1, "min_batch_tokens": 8, "max_batch_tokens": 128,
        "max_batch_wait_s": 0.005}
AFD = {"mode": "afd", "attn_workers": 1, "ffn_workers": 1, "micro_batches": 2}

MATRIX = [
    ("deepseek_v32", {"mode": "colocated"}, {"mode": "colocated"}, 1, 1),  # DSA: latent + indexer keys
    # heads split on the prefill side, whole on the decode side (test_pd_roles runs this pair in make test)
    pytest.param("qwen3", dict(ASAP, attn_tp=2), AFD, 1, 1, marks=pytest.mark.slow),
    ("deepseek_v3", {"mode": "dwdp", "dp": 2}, {"mode": "dep", "dp": 2}, 1, 1),  # MLA
    pytest.param("qwen3", ASAP, AFD, 1, 1, marks=pytest.mark.slow),
    pytest.param("qwen3", {"mode": "colocated"}, {"mode": "colocated"}, 2, 2, marks=pytest.mark.slow),  # xPyD
    pytest.param("qwen3", {"mode": "dwdp", "dp": 2}, {"mode": "dep", "dp": 2}, 1, 1, marks=pytest.mark.slow),
    pytest.param("qwen3", {"mode": "dep", "dp": 2, "chunked_prefill_size": 16}, AFD, 1, 1, marks=pytest.mark.slow),
    pytest.param("qwen3", dict(ASAP, attn_tp=2), {"mode": "dep", "dp": 2}, 1, 1, marks=pytest.mark.slow),
    pytest.param("deepseek_v3", ASAP, AFD, 1, 1, marks=pytest.mark.slow),
    pytest.param("deepseek_v3", {"mode": "dep", "dp": 2, "chunked_prefill_size": 16}, AFD, 1, 1,
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v3", dict(ASAP, attn_tp=2), {"mode": "dep", "dp": 2}, 1, 1, marks=pytest.mark.slow),
    pytest.param("deepseek_v32", ASAP, AFD, 1, 1, marks=pytest.mark.slow),
    pytest.param("deepseek_v32", {"mode": "dwdp", "dp": 2}, {"mode": "dep", "dp": 2}, 1, 1, marks=pytest.mark.slow),
    pytest.param("deepseek_v32", {"mode": "dep", "dp": 2, "chunked_prefill_size": 16}, AFD, 1, 1,
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v32", dict(ASAP, attn_tp=2), {"mode": "dep", "dp": 2}, 1, 1, marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3", "deepseek_v3", "deepseek_v32"))


def assert_all_returned(engine) -> None:
    """Zero stranded blocks: every instance's cache is whole again, nothing leased or reserved, no stage open."""
    for e in engine.instances:
        pool = e.scheduler.pool
        assert not pool.leases and not e.handoff_port().arrivals.reserved
        assert all(g.allocator.num_free == g.allocator.num_blocks for g in pool.groups)
    assert engine.kv.in_flight == 0 and engine.kv.heap.used_bytes == 0 and not engine.handoffs


@pytest.mark.parametrize("name,prefill,decode,x,y", MATRIX)
def test_pd_matches_colocated(checkpoints, reference, name, prefill, decode, x, y):
    with LLM(checkpoints(name).path, dtype="float32", mode="pd", prefill=prefill, decode=decode,
             prefill_instances=x, decode_instances=y) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        engine = llm.engine
        stats = engine.kv.stats
        assert_all_returned(engine)
        arena = engine.kv.arena.segment.path
    assert_same(outs, reference[name])
    # the KV arrived: one handoff per request, none recomputed, every byte of every prompt counted
    assert stats.transfers == len(PROMPTS) and stats.recomputes == 0 and stats.failures == 0
    assert stats.bytes_total == sum(engine.kv.bytes_for(len(p)) for p in PROMPTS)
    for e in engine.instances:
        if hasattr(e, "deployment_id"):
            assert list_segments(e.deployment_id) == []
    import os
    assert not os.path.exists(arena)
