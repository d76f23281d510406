"""Failure isolation (issue 18, item 2): a batch that raises while it runs fails its own requests,
with its error, and the deployment goes on serving; and the Python API's restart policy.

The failure is real, not injected by a hook: a prompt with a token id outside the vocabulary is
put on the scheduler directly, past ``validate_request`` (bad input that slipped through), so the
worker's embedding raises ``IndexError`` in the middle of a work item. In the process modes the
failed batch still walks every layer on zeros, so its peers (the other dep rank, the MoE workers,
the FFN daemons, the dwdp copy thread) are never left waiting for it.
"""
from __future__ import annotations

import os
import signal

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments
from moeflow.config import ConfigError
from moeflow.engine.restart import RestartPolicy

from parity import PARAMS, PROMPTS, assert_same

pytestmark = pytest.mark.slow

DEPLOYMENTS = {
    "colocated": {},
    "dep": dict(dp=2),
    "asap": dict(attn_dp=2, moe_workers=1),
    "dwdp": dict(dp=2, placement="round_robin"),
    "afd": dict(attn_workers=2, ffn_workers=1, micro_batches=2),
}


@pytest.fixture(scope="module")
def reference(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32") as llm:
        return llm.generate(PROMPTS, PARAMS)


def _slip_in(llm: LLM, request) -> None:
    """Queue ``request`` without the engine's checks, as a bug in them would."""
    llm.engine.scheduler.add(request)
    if llm.mode == "colocated":  # the in-process runner learns requests at intake
        llm.engine.runner.add_request(request.request_id, request.prompt_token_ids, request.params)


def _run(llm: LLM, good: list, bad) -> dict:
    """Good requests first, the bad one once they are decoding; every request's final state."""
    for r in good:
        llm.engine.add_request(r)
    ended = {}
    for _ in range(3):  # the good prompts are prefilled (the longest in one chunk) before the bad one comes
        ended.update({r.request_id: r for r in llm.engine.step().finished})
    _slip_in(llm, bad)
    for _ in range(10_000):
        if not llm.engine.has_unfinished():
            break
        ended.update({r.request_id: r for r in llm.engine.step().finished})
    llm.engine.drain()
    assert not llm.engine.has_unfinished(), "requests still unfinished after 10k steps"
    return ended


@pytest.mark.parametrize("mode", sorted(DEPLOYMENTS))
def test_a_failing_batch_fails_only_its_requests(checkpoints, reference, mode):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode=mode, **DEPLOYMENTS[mode]) as llm:
        vocab = llm.engine.model_config.vocab_size
        good = [llm.make_request(p, PARAMS, request_id=f"good{i}") for i, p in enumerate(PROMPTS)]
        bad = llm.make_request([1, 2, vocab + 5], PARAMS, request_id="bad")
        ended = _run(llm, good, bad)
        assert llm.engine.failed is None  # the deployment is still up

        assert ended["bad"].finish_reason == "error"
        assert "IndexError" in ended["bad"].error and "batch" in ended["bad"].error, ended["bad"].error
        if mode != "colocated":
            assert "embedding failed" in ended["bad"].error
        failed = {rid for rid, r in ended.items() if r.finish_reason == "error"}
        # the requests that failed are exactly the bad one's batch: one error for all of them
        assert len({ended[rid].error for rid in failed}) == 1
        survivors = [i for i, r in enumerate(good) if r.request_id not in failed]
        for i in survivors:  # what did not share the batch is exactly what the reference produced
            assert ended[good[i].request_id].output_token_ids == reference[i].outputs[0].token_ids
        if mode in ("dep", "dwdp", "afd", "asap"):  # two groups: the other group's requests go on
            assert survivors, f"every request failed with the bad one: {sorted(failed)}"

        # and the deployment serves a whole new round exactly as the reference
        assert_same(llm.generate(PROMPTS, PARAMS), reference)
        deployment_id = getattr(llm.engine, "deployment_id", None)
    if deployment_id is not None:
        assert list_segments(deployment_id) == []


def test_the_python_api_restarts_a_failed_deployment_when_asked(checkpoints, reference):
    sleeps = []
    llm = LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2, max_restarts=2, restart_backoff_s=0.01)
    try:
        old_id = llm.engine.deployment_id
        os.kill(llm.engine.deployment.workers[1].process.pid, signal.SIGKILL)
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
        assert all(o.error and "exited unexpectedly" in o.error for o in outs)  # the affected requests end
        assert llm.engine.failed is not None and llm.restarts == 0
        assert_same(llm.generate(PROMPTS, PARAMS), reference)  # rebuilt before this call
        assert llm.restarts == 1 and llm.engine.deployment_id != old_id
        assert list_segments(old_id) == []  # nothing of the dead deployment is left
        # a back-off doubles per attempt of one run
        llm.engine.failed = "pretend"
        llm._up_since = float("inf")  # it "failed again at once": the same run of attempts goes on
        llm.restart(sleep=sleeps.append)
        assert sleeps == [0.02] and llm.restarts == 2
        llm.engine.failed = "pretend"
        with pytest.raises(Exception, match="2 restart attempt"):
            llm.restart(sleep=sleeps.append)  # the run's two attempts are spent
    finally:
        llm.shutdown()
    assert list_segments(llm.engine.deployment_id) == []


def test_the_python_api_does_not_restart_by_default(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2) as llm:
        os.kill(llm.engine.deployment.workers[0].process.pid, signal.SIGKILL)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, ignore_eos=True))
        with pytest.raises(Exception, match="has failed"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_restart_policy_validation():
    assert RestartPolicy(3, 0.5).delay_s(0) == 0.5 and RestartPolicy(3, 0.5).delay_s(2) == 2.0
    assert RestartPolicy(9, 1.0, max_backoff_s=4.0).delay_s(5) == 4.0
    with pytest.raises(ConfigError, match="max_restarts"):
        RestartPolicy(-1)
    with pytest.raises(ConfigError, match="backoff_s"):
        RestartPolicy(1, -0.5)
