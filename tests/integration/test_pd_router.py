"""Prefill and decode as separate servers behind ``moeflow router``, driven by the official openai
client: an asap prefill server hands each request's KV to an afd decode server; completions (whole
and streamed) and chat equal a colocated run's greedy text and logprobs; both servers' /metrics
count the handoffs; every block and staged range returns on both sides; a router over servers of
two different models, or of one model with other weights, refuses to start, naming both; a staged
range is released only by whoever holds its token."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from moeflow import LLM, SamplingParams

from conftest import build_hf_model, save_checkpoint
from server_harness import ServerProcess

PREFILL = ["--role", "prefill", "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1", "--min-batch-tokens", "8",
           "--max-batch-wait-s", "0.005"]
DECODE = ["--role", "decode", "--mode", "afd", "--attn-workers", "1", "--ffn-workers", "1"]
COMMON = ["--dtype", "float32", "--served-model-name", "m", "--max-model-len", "256"]
PROMPTS = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(40, 70)), list(range(3, 60))]


@pytest.fixture(scope="module")
def split(checkpoints, tmp_path_factory):
    path = checkpoints("qwen3").path
    logs = tmp_path_factory.mktemp("pd-router")
    servers = []
    try:
        servers.append(ServerProcess(path, *PREFILL, *COMMON, log_path=str(logs / "prefill.log")))
        servers.append(ServerProcess(path, *DECODE, *COMMON, log_path=str(logs / "decode.log")))
        servers.append(ServerProcess(None, "--prefill", servers[0].url, "--decode", servers[1].url,
                                     log_path=str(logs / "router.log")))
        yield path, *servers
    finally:
        for s in reversed(servers):
            s.stop()


def wait_clean(*servers) -> list[dict]:
    """Every server's KV back to full, nothing staged or pending (released ranges are reaped async)."""
    deadline = time.monotonic() + 10
    while True:
        infos = [httpx.get(s.url + "/v1/kv_transfer", timeout=5).json() for s in servers]
        if all(i["num_free_kv_blocks"] == i["num_kv_blocks"] and i["num_handoffs"] == 0 for i in infos):
            return infos
        assert time.monotonic() < deadline, infos
        time.sleep(0.1)


def test_router_matches_colocated(split):
    path, prefill, decode, router = split
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(path, dtype="float32") as ref:
        expected = ref.generate(PROMPTS, sp)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    for ids, e in zip(PROMPTS, expected):
        r = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
        want = e.outputs[0]
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
        got_lp = r.choices[0].logprobs.token_logprobs
        assert max(abs(a - b[t].logprob) for a, t, b in zip(got_lp, want.token_ids, want.logprobs)) < 1e-3
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(ids)
        chunks = list(client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 5
    handed = 2 * len(PROMPTS) + 1
    pm, dm = prefill.metrics(), decode.metrics()
    assert dm['moeflow_kv_transfer_seconds_count{path="shm"}'] == handed  # one host: read from shared memory
    # in place: the prefill server offered its blocks, copying nothing; the decode server's members copied once
    assert pm['moeflow_kv_transfer_seconds_count{path="in-place"}'] == handed
    assert 'moeflow_kv_transfer_seconds_count{path="stage"}' not in pm
    assert dm['moeflow_kv_transfer_bytes_total{path="shm"}'] == pm['moeflow_kv_transfer_bytes_total{path="in-place"}'] > 0
    wait_clean(prefill, decode)


def test_router_refuses_servers_of_two_models(checkpoints, split, tmp_path):
    _, prefill, _, _ = split
    other = ServerProcess(checkpoints("deepseek_v3").path, "--role", "decode", *COMMON,
                          log_path=str(tmp_path / "other.log"))
    try:
        p = subprocess.run([sys.executable, "-m", "moeflow", "router", "--prefill", prefill.url, "--decode",
                            other.url, "--wait-s", "10"], capture_output=True, text=True, timeout=60)
    finally:
        other.stop()
    assert p.returncode == 2
    assert f"{other.url} runs DeepseekV3ForCausalLM" in p.stderr and f"but {prefill.url} runs Qwen3Moe" in p.stderr


def _handoff(prefill, ids) -> dict:
    """A prefill answer's kv_transfer_params, asked for directly (as the router does)."""
    r = httpx.post(prefill.url + "/v1/completions", timeout=30, json={
        "model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_a_staged_range_is_released_only_with_its_token(split):
    """The red-team's forged release: the server id is in every answer and transfer ids count up, so
    anyone could free anyone's staged KV (and, with it, a decode server's read flags)."""
    _, prefill, decode, _ = split
    h = _handoff(prefill, PROMPTS[2])
    release = prefill.url + "/v1/kv_transfer/release"
    forged = {**h, "remote_token": f"{(int(h['remote_token'], 16) + 1) % (1 << 63):016x}"}
    r = httpx.post(release, json=forged, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert httpx.get(prefill.url + "/v1/kv_transfer").json()["num_handoffs"] == 1  # still offered
    assert httpx.post(release, json={k: v for k, v in h.items() if k != "remote_token"}, timeout=10).status_code == 400
    assert httpx.post(release, json=h, timeout=10).json() == {"released": h["remote_transfer_id"]}
    assert httpx.post(release, json=h, timeout=10).status_code == 404  # gone
    wait_clean(prefill, decode)


def test_router_refuses_servers_of_other_weights(split, tmp_path):
    """Same architecture, same KV layout, other weights: a decode server that took the KV would
    answer with another model's text, silently. The router refuses to start, and the decode server
    refuses the handle."""
    path, prefill, _, _ = split
    other_path = save_checkpoint(build_hf_model("qwen3_moe", seed=1), str(tmp_path / "qwen3-seed1"))
    other = ServerProcess(other_path, *DECODE, *COMMON, log_path=str(tmp_path / "other.log"))
    try:
        ours = httpx.get(prefill.url + "/v1/kv_transfer").json()
        theirs = httpx.get(other.url + "/v1/kv_transfer").json()
        assert ours["kv_layout"] == theirs["kv_layout"] and ours["weights"] != theirs["weights"]
        p = subprocess.run([sys.executable, "-m", "moeflow", "router", "--prefill", prefill.url, "--decode",
                            other.url, "--wait-s", "10"], capture_output=True, text=True, timeout=60)
        h = _handoff(prefill, PROMPTS[1])
        r = httpx.post(other.url + "/v1/completions", timeout=30, json={
            "model": "m", "prompt": PROMPTS[1], "max_tokens": 4, "kv_transfer_params": h})
        httpx.post(prefill.url + "/v1/kv_transfer/release", json=h, timeout=10)
    finally:
        other.stop()
    assert p.returncode == 2
    assert f"{other.url} holds weights {theirs['weights']} but {prefill.url} holds {ours['weights']}" in p.stderr
    assert r.status_code == 400 and "prefilled by weights" in r.json()["error"]["message"], r.text
