"""Mode dep (the synchronous baselines) against the colocated reference: real rank processes."""
from __future__ import annotations

import os
import signal

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs

@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3", "qwen2_moe", "deepseek_v3", "deepseek_v32", "deepseek_v3_yarn"))


@pytest.mark.parametrize("name,dp,chunk,placement", [
    # make test: one case per path (the rest, the full matrix, carry `slow`: make test-slow)
    pytest.param("qwen3", 1, None, "least_loaded", marks=pytest.mark.slow),
    pytest.param("qwen3", 2, None, "least_loaded", marks=pytest.mark.slow), ("qwen3", 3, None, "round_robin"),
    ("qwen3", 2, 16, "least_loaded"),  # the 57-token prompt runs in 4 chunks over the cache of the earlier ones
    ("qwen2_moe", 3, 8, "least_loaded"),  # shared expert + a dense layer; ranks get 3/3/2 experts
    pytest.param("deepseek_v3", 2, 16, "least_loaded", marks=pytest.mark.slow),  # MLA chunks (v32's too), grouped sigmoid routing
    ("deepseek_v32", 2, 16, "least_loaded"),  # DSA: index keys cached chunk by chunk, top-12 of up to 57 keys
    ("deepseek_v3_yarn", 2, None, "round_robin"),  # YaRN frequencies and softmax scale on every rank
])
def test_dep_matches_colocated(checkpoints, reference, name, dp, chunk, placement):
    refs = reference[name]
    with LLM(checkpoints(name).path, dtype="float32", mode="dep", dp=dp, chunked_prefill_size=chunk,
             placement=placement, trace=True) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        spans = llm.engine.collect_spans()
        deployment_id = llm.engine.deployment_id
    assert_same(outs, refs)
    assert list_segments(deployment_id) == []
    if dp > 1:  # a rank with no work still took part in every exchange (dummy steps)
        ranks = {s.track.split("/")[0] for s in spans if s.name == "wait-dispatch"}
        assert ranks == {f"dep{r}" for r in range(dp)}


def test_dep_over_torch_distributed_matches_colocated(checkpoints, reference):
    """The transport dep runs across hosts, on one: gloo between ranks, each rank's link to its
    own experts a loopback in process."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=3, transport="dist") as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same(outs, reference["qwen3"])


def test_dead_rank_fails_requests_and_cleans_up(checkpoints):
    llm = LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2)
    pids = [w.process.pid for w in llm.engine.deployment.workers]
    os.kill(pids[1], signal.SIGKILL)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "error" and "dep worker 1" in o.error for o in outs)
    llm.shutdown()
    assert list_segments(llm.engine.deployment_id) == []


def test_a_step_left_out_by_an_abort_is_drained_before_anything_else_reads_the_ranks(checkpoints, reference):
    """A dep step returns before its ranks answer (``max_wait_s``, so that pd's loop turns); aborting
    its requests then must not leave that step out: ``drain`` collects it, and ``collect_spans`` (a
    benchmark's, between probes) finds the deployment idle. Before, drain did nothing for dep and
    collect_spans dropped the step's answers, so the next request waited for them until the stall
    watchdog failed the deployment (a plan validation's probes, an SLO search stopped early)."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2, trace=True) as llm:
        e = llm.engine
        e.max_wait_s = 0.0  # the step is issued and left out, as in pd's loop
        r = llm.make_request(PROMPTS[4], SamplingParams(max_tokens=8, ignore_eos=True))
        e.add_request(r)
        e.step()
        assert e._busy()
        e.abort(r.request_id)
        e.drain()
        assert not e._busy() and e.collect_spans()
        e.max_wait_s = 0.05
        assert_same(llm.generate(PROMPTS, PARAMS), reference["qwen3"])
