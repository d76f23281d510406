"""Mode afd against the colocated reference: real attention-instance and FFN-daemon processes,
m micro-batches per step, block and all topologies, the router on either side; a dead worker fails
every request within seconds and leaves nothing behind."""
from __future__ import annotations

import os
import signal
import time

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs


@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3", "qwen2_moe", "deepseek_v3"))


@pytest.mark.parametrize("name,m,n,ub,options", [
    pytest.param("qwen3", 1, 1, 1, {}, marks=pytest.mark.slow),  # the plain case of the chunked one below
    pytest.param("qwen3", 2, 1, 2, {"overlap_scheduling": False}, marks=pytest.mark.slow),  # make test-slow
    ("qwen3", 3, 2, 2, {"chunked_prefill_size": 16}),  # uneven blocks: daemon 0 serves 0 and 2, daemon 1 serves 1
    pytest.param("qwen3", 2, 2, 3, {"topology": "all", "transport": "dist"},  # experts split; over torch.distributed
                 marks=pytest.mark.slow),
    ("qwen2_moe", 2, 2, 2, {"topology": "all", "router": "ffn"}),  # shared expert, a dense layer; partial sums
    ("deepseek_v3", 2, 1, 2, {}),  # MLA, grouped sigmoid routing, a leading dense layer
    pytest.param("deepseek_v3", 3, 2, 2, {"router": "ffn", "placement": "round_robin"}, marks=pytest.mark.slow),
])
def test_afd_matches_colocated(checkpoints, reference, name, m, n, ub, options):
    transport = options.pop("transport", "shm")
    with LLM(checkpoints(name).path, dtype="float32", mode="afd", attn_workers=m, ffn_workers=n, micro_batches=ub,
             max_batch_tokens=64, transport=transport, trace=True, **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        spans = llm.engine.collect_spans()
        deployment = llm.engine.deployment
    assert_same(outs, reference[name])
    assert list_segments(llm.engine.deployment_id) == []
    assert all(not w.process.is_alive() for w in deployment.workers)
    ffn = [s for s in spans if s.track.startswith("ffn")]
    assert ffn and {"experts", "recv", "combine-send"} <= {s.name for s in ffn}
    cfg = llm.engine.model_config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 * cfg.num_moe_layers
    for w in deployment.workers:
        if w.role == "ffn":  # all experts (block) or its share (all); never a KV cache
            held = cfg.num_experts if llm.layout.topology == "block" else len(llm.layout.experts_held(cfg.num_experts)[w.index])
            assert w.memory["routed_experts"] == held * per_expert and "kv_cache" not in w.memory
            assert (w.memory["gates"] > 0) == (llm.layout.router == "ffn")
        else:
            assert w.memory["routed_experts"] == 0 and w.memory["kv_cache"] > 0


def test_micro_batches_really_interleave(checkpoints):
    """With two micro-batches the daemon computes one while the instance runs the other's attention:
    an ffn 'experts' span overlaps an instance 'attention' span of the other micro-batch. A serial
    walk never overlaps; the interleaved one does only when the daemon wakes inside the other
    micro-batch's attention, which on the tiny model and two shared cores happens in most steps but
    not in every generate (0 overlaps in 2 of 6 eight-token runs here), so up to five runs."""
    prompts = [list(range(3, 60)), list(range(40, 97))]
    overlaps = 0
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="afd", micro_batches=2, trace=True) as llm:
        for _ in range(5):
            llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
            spans = llm.engine.collect_spans()
            attn = [s for s in spans if s.name == "attention" and s.track.startswith("afd_attention")]
            experts = [s for s in spans if s.name == "experts" and s.track.startswith("ffn")]
            overlaps = sum(1 for a in attn for e in experts if a.start_s < e.end_s and e.start_s < a.end_s)
            if overlaps:
                break
    assert overlaps > 0


@pytest.mark.parametrize("victim", ["ffn", "afd_attention"])
def test_a_dead_worker_fails_every_request_within_seconds(checkpoints, victim):
    llm = LLM(checkpoints("qwen3").path, dtype="float32", mode="afd", attn_workers=2, ffn_workers=1)
    engine, deployment_id = llm.engine, llm.engine.deployment_id
    workers = list(engine.deployment.workers)
    try:
        reqs = [llm.make_request(p, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)) for p in PROMPTS]
        for r in reqs:
            engine.add_request(r)
        for _ in range(3):
            engine.step()
        os.kill(next(w for w in workers if w.role == victim).process.pid, signal.SIGKILL)
        t0, done = time.monotonic(), {}
        while len(done) < len(reqs) and time.monotonic() - t0 < 10:
            done.update({r.request_id: r for r in engine.step().finished})
        assert time.monotonic() - t0 < 10
        assert {r.finish_reason for r in done.values()} == {"error"} and len(done) == len(reqs)
        assert engine.failed is not None and victim in engine.failed
    finally:
        llm.shutdown()
    assert list_segments(deployment_id) == []
    assert all(not w.process.is_alive() for w in workers)


def test_same_budget_more_requests_without_experts(checkpoints):
    """dep vs afd on the same per-process budget: the instance holds no routed experts, so its KV
    cache gets their bytes; what each worker reports holding matches the plan."""
    kw = dict(dtype="float32", max_batch_tokens=64, memory_budget_gib=0.03, max_num_seqs=8)
    blocks = {}
    for mode, opts in [("dep", {"dp": 2}), ("afd", {"attn_workers": 1, "ffn_workers": 1})]:
        with LLM(checkpoints("qwen3").path, mode=mode, **kw, **opts) as llm:
            plan = llm.engine.memory_plan
            blocks[mode] = plan.num_kv_blocks
            for w, p in zip(sorted(llm.engine.deployment.workers, key=lambda w: w.role != "ffn"),
                            sorted(plan.processes, key=lambda p: not p.name.startswith("ffn"))):
                assert w.memory.get("kv_cache", 0) == plan.kv_bytes(p)
                weights = sum(v for k, v in w.memory.items() if k in ("routed_experts", "other_weights", "gates"))
                assert weights == p.weights
            assert llm.generate(PROMPTS[:2], PARAMS)[0].error is None
    assert blocks["afd"] > blocks["dep"]
