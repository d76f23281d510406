"""afd's FFN daemons N -> N' while the deployment serves: a daemon that joins reads its experts from
its peers and serves from the next step; one that leaves goes after its in-flight items; outputs
equal colocated's (fp32) before, between and after every change, in flight too; nothing is left
behind; a target that cannot be is refused with its reason; a joiner killed before the switch fails
its change and the deployment serves on as it was."""
from __future__ import annotations

import os
import signal
import time

import pytest

from moeflow import LLM
from moeflow.comm import list_segments
from moeflow.config import ConfigError

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs, generate_while_draining

ELASTIC = dict(dtype="float32", mode="afd", attn_workers=2, ffn_workers=2, topology="all", max_ffn_workers=3,
               max_batch_tokens=64)


@pytest.mark.parametrize("router", ["attention", "ffn"])
def test_ffn_daemons_join_and_leave_equal_to_colocated(checkpoints, router):
    path = checkpoints("qwen3").path
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(path, router=router, **ELASTIC) as llm:
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        up = llm.scale(ffn=3)
        assert up["ffn"] == 3 and not up["in_progress"] and up["events"][-1]["outcome"] == "done", up
        assert sorted(w.index for w in llm.engine.deployment.workers if w.role == "ffn") == [0, 1, 2]
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        # a change under way while requests are in flight: the generate call keeps the engine turning
        llm.scale(ffn=2, wait=False)
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        down = llm.scale(wait=True)
        assert down["ffn"] == 2 and down["events"][-1]["outcome"] == "done" and down["events"][-1]["seconds"] > 0
        assert sorted(w.index for w in llm.engine.deployment.workers if w.role == "ffn") == [0, 1]
        llm.scale(ffn=3)  # the same index joins again: a new daemon, new buffers
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        with pytest.raises(ConfigError, match=r"1 ffn workers of 4 slots hold 4 experts, fewer than the model's 8"):
            llm.scale(ffn=1)
        with pytest.raises(ConfigError, match=r"4 is outside \[1, 3\]"):
            llm.scale(ffn=4)
        deployment, dep_id = llm.engine.deployment, llm.engine.deployment_id
    assert list_segments(dep_id) == []
    assert all(not w.process.is_alive() for w in deployment.workers)


def test_a_fixed_deployment_refuses_to_scale(checkpoints):
    with LLM(checkpoints("qwen3").path, dtype="float32", mode="afd", attn_workers=1, ffn_workers=1) as llm:
        with pytest.raises(ConfigError, match="ffn workers are fixed; start it with max_ffn_workers"):
            llm.scale(ffn=2)
    with pytest.raises(ConfigError, match="max_ffn_workers .* needs topology 'all'"):
        LLM(checkpoints("qwen3").path, dtype="float32", mode="afd", attn_workers=2, ffn_workers=1, max_ffn_workers=2)


def test_a_joiner_killed_before_the_switch_fails_only_its_change(checkpoints):
    path = checkpoints("qwen3").path
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(path, **ELASTIC) as llm:
        llm.scale(ffn=3, wait=False)
        membership = llm.engine.eplb.membership
        deadline = time.monotonic() + 30
        while not membership.joiners:
            llm.engine.step()
            assert time.monotonic() < deadline
        os.kill(membership.joiners[0].process.pid, signal.SIGKILL)
        status = llm.scale(wait=True)
        assert status["ffn"] == 2 and status["events"][-1]["outcome"].startswith("failed: "), status
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        assert llm.scale(ffn=3)["events"][-1]["outcome"] == "done"  # and a new try succeeds
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        dep_id = llm.engine.deployment_id
    assert list_segments(dep_id) == []



def test_the_server_scales_on_post_scale(checkpoints, tmp_path):
    """POST /scale (and SGLang's /scale_elastic_ep), GET /scale to follow it, /metrics counting it,
    completions answered before and after, and a refusal answered 400 with its reason."""
    import httpx

    from server_harness import ServerProcess

    server = ServerProcess(checkpoints("qwen3").path, "--mode", "afd", "--attn-workers", "2", "--ffn-workers", "2",
                           "--topology", "all", "--max-ffn-workers", "3", "--dtype", "float32",
                           "--served-model-name", "m", log_path=str(tmp_path / "serve.log"))
    try:
        def complete():
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        want = complete()
        for url, body, n in (("/scale", {"ffn": 3}, 3), ("/scale_elastic_ep", {"new_ep_size": 2}, 2)):
            r = httpx.post(server.url + url, json=body, timeout=30)
            assert r.status_code == 200 and r.json()["target"] == n, r.text
            deadline = time.monotonic() + 60
            while (s := httpx.get(server.url + "/scale", timeout=30).json())["in_progress"]:
                assert time.monotonic() < deadline, s
                time.sleep(0.1)
            assert s["ffn"] == n and s["events"][-1]["outcome"] == "done", s
            assert complete() == want
        bad = httpx.post(server.url + "/scale", json={"ffn": 9}, timeout=30)
        assert bad.status_code == 400 and "9 is outside [1, 3]" in bad.json()["error"]["message"]
        m = server.metrics()
        assert m['moeflow_members{role="ffn"}'] == 2 and m['moeflow_scale_events_total{kind="ffn",outcome="done"}'] == 2
    finally:
        server.stop()


@pytest.mark.parametrize("shared", [False, True], ids=["drained", "handed-over"])
def test_attention_instances_join_and_leave_equal_to_colocated(checkpoints, monkeypatch, shared):
    """M 1 -> 2 -> 1 -> 2 at step boundaries (the daemons aggregate every instance of a step), the
    leaver holding requests (drained, or handed over with its KV), and FFN daemons joining under the
    new instances: equal to colocated."""
    (want,) = colocated_outputs(checkpoints, ("qwen3",)).values()
    with LLM(checkpoints("qwen3").path, **(ELASTIC | dict(attn_workers=1, max_attn_workers=2, max_num_seqs=8,
                                                          share_kv_cache=shared))) as llm:
        up = llm.scale(attention=2)
        assert up["attention"] == 2 and up["events"][-1]["outcome"] == "done", up
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        generate_while_draining(llm, monkeypatch, want)  # instance 1 drains with requests resident
        down = llm.scale(wait=True)
        assert down["attention"] == 1 and (down["events"][-1]["handed"] > 0) == shared, down
        assert llm.scale(attention=2)["attention"] == 2  # the same index joins again, new buffers
        assert llm.scale(ffn=3)["ffn"] == 3  # a daemon that joins serves both instances
        assert_same(llm.generate(PROMPTS, PARAMS), want)
        dep_id = llm.engine.deployment_id
    assert list_segments(dep_id) == []
