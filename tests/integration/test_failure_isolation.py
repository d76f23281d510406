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
import time

import pytest

from moeflow import LLM, SamplingParams
from moeflow.comm import list_segments
from moeflow.config import ConfigError
from moeflow.engine.restart import RestartCount, RestartPolicy

from parity import PARAMS, PROMPTS, assert_same


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


def test_the_python_api_restarts_a_failed_deployment_when_asked(checkpoints, reference, monkeypatch, tmp_path):
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
        # a deployment that fails again at once after coming up is rebuilt again (a crash loop backs
        # off further but never counts towards max_restarts: only attempts that fail to build do)
        for _ in range(2):
            llm.engine.failed = "pretend"
            llm.restart(sleep=sleeps.append)
        assert sleeps == [0.02, 0.04] and llm.restarts == 3  # more than max_restarts, each one up
        llm.engine.failed = "pretend"
        monkeypatch.setattr(llm, "model_path", str(tmp_path / "gone"))  # every build fails now
        with pytest.raises(Exception, match=r"failed \(pretend\) and 2 restart attempt\(s\) in a row failed to "
                                            r"bring it back \(the last: CheckpointError: .*gone"):
            llm.restart(sleep=sleeps.append)
    finally:
        llm.shutdown()
    assert list_segments(llm.engine.deployment_id) == []


def test_a_stopped_rank_fails_the_global_step_after_the_stall_timeout(checkpoints):
    """dep's step waits for every rank: a SIGSTOPped one held it forever. The watchdog inside that
    wait fails the step's requests, naming the stall and the stopped process, and kills it."""
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2, stall_timeout_s=2.0) as llm:
        victim = llm.engine.ranks[1].process.pid
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50, ignore_eos=True))[0]
        finally:
            if os.path.exists(f"/proc/{victim}"):
                os.kill(victim, signal.SIGCONT)
        took_s = time.monotonic() - t0
        assert out.error and "stalled" in out.error and f"pid {victim}) is stopped" in out.error, out.error
        assert 2.0 <= took_s < 10, took_s
        assert llm.engine.stalls == 1 and llm.engine.failed is not None


def test_the_python_api_does_not_restart_by_default(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="dep", dp=2) as llm:
        os.kill(llm.engine.deployment.workers[0].process.pid, signal.SIGKILL)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, ignore_eos=True))
        with pytest.raises(Exception, match="has failed"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_only_attempts_that_fail_to_come_up_count():
    """Six deaths, each after a successful restart, with max_restarts 5: never given up (the server
    used to say "5 restart attempt(s) in a row did not bring it back" although all five had); two
    failed builds in a row with max_restarts 2 are."""
    count = RestartCount(RestartPolicy(5, 1.0, max_backoff_s=30.0, min_uptime_s=60.0), up_since_s=0.0)
    delays = []
    for t in range(6):
        count.failed(now_s=20.0 * t + 10)  # every 20 s: a crash loop
        assert not count.exhausted
        delays.append(count.delay_s())
        count.came_up(now_s=20.0 * t + 11)
    assert count.restarts == 6 and delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]  # the loop backs off
    count.failed(now_s=1000.0)  # up for long: a fresh back-off
    assert count.delay_s() == 1.0
    two = RestartCount(RestartPolicy(2, 1.0))
    two.failed(now_s=0.0)
    for _ in range(2):
        assert not two.exhausted
        two.attempt_failed()
    assert two.exhausted and two.failed_attempts == 2


def test_restart_policy_validation():
    assert RestartPolicy(3, 0.5).delay_s(0) == 0.5 and RestartPolicy(3, 0.5).delay_s(2) == 2.0
    assert RestartPolicy(9, 1.0, max_backoff_s=4.0).delay_s(5) == 4.0
    with pytest.raises(ConfigError, match="max_restarts"):
        RestartPolicy(-1)
    with pytest.raises(ConfigError, match="backoff_s"):
        RestartPolicy(1, -0.5)
