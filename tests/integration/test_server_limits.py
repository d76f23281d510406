"""Admission bound, client disconnects and ``--api-key`` against a real ``moeflow serve``.

One server: at most 3 unfinished requests (``--max-pending-requests 3``), one running at a time
(``--max-num-seqs 1``, so the other two queue), and an API key. The test checkpoint has no EOS:
every request runs to its max_tokens, which makes the arithmetic exact.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from server_harness import ServerProcess

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 3


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_limits") / "server.log"
    # the key from vLLM's variable (MOEFLOW_API_KEY comes first): not on the command line for all to read
    s = ServerProcess(checkpoints("qwen3").path, "--served-model-name", "m", "--max-pending-requests", str(LIMIT),
                      "--max-num-seqs", "1", log_path=str(log), env={"VLLM_API_KEY": KEY, "MOEFLOW_API_KEY": ""})
    yield s
    assert s.stop() in (0, 143), s.log()


def _settled(server, timeout_s: float = 10.0) -> dict:
    """Metrics once nothing is pending any more (the engine thread has caught up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics(AUTH)
        if m["moeflow_requests_pending"] == 0 and m["moeflow_requests_running"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_api_key_guards_every_route_but_health(server):
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/openapi.json"), ("GET", "/docs")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "hi"})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        out = client.completions.create(model="m", prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens == 2
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


@pytest.mark.parametrize("headers,status,code", [({}, 401, "invalid_api_key"), (AUTH, 413, "body_too_large")])
def test_a_refused_large_body_still_gets_its_answer_to_urllib(server, headers, status, code):
    """Either guard reads the refused body before answering: urllib writes it all before it reads."""
    body = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'  # over the default 4 MiB limit and the socket buffers
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **headers})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status and json.loads(e.value.read())["error"]["code"] == code


async def _flood(url: str, n: int, max_tokens: int):
    """n requests at once (every other one streamed) while sampling the queue gauges."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
        async def one(i: int):
            body = {"prompt": f"request {i}", "max_tokens": max_tokens, "temperature": 0}
            t0 = time.monotonic()
            if i % 2:
                r = await c.post("/v1/completions", json=body)
                return r.status_code, (r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.json()), \
                    time.monotonic() - t0
            body.update(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.json(), time.monotonic() - t0
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return 200, json.loads(events[-2])["usage"]["completion_tokens"], time.monotonic() - t0

        async def gauges():
            seen = []
            for _ in range(40):
                await asyncio.sleep(0.05)
                text = (await c.get("/metrics")).text
                seen.append({k: float(v) for k, v in (line.split() for line in text.splitlines()
                                                      if line.startswith("moeflow_requests_") and "{" not in line)})
            return seen

        *results, seen = await asyncio.gather(*(one(i) for i in range(n)), gauges())
        return results, seen


def test_overload_gets_429_at_once_and_no_accepted_request_is_lost(server):
    before = server.metrics(AUTH)
    n, max_tokens = 12, 120
    results, seen = asyncio.run(_flood(server.url, n, max_tokens))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == n, [r[:2] for r in results]
    assert len(ok) >= LIMIT and refused
    assert all(tokens == max_tokens for _, tokens, _ in ok)  # every accepted request ran to the end
    assert all(err["error"]["code"] == "queue_full" for _, err, _ in refused)
    assert max(t for *_, t in refused) < min(t for *_, t in ok)  # refused at once, not after waiting
    assert max(s["moeflow_requests_pending"] for s in seen) <= LIMIT
    assert max(s["moeflow_requests_waiting"] for s in seen) >= 1  # the bound queues, then refuses
    m = _settled(server)
    done = m['moeflow_requests_finished_total{finish_reason="length"}'] - before.get(
        'moeflow_requests_finished_total{finish_reason="length"}', 0)
    assert done == len(ok) and m["moeflow_kv_blocks_free"] == m["moeflow_kv_blocks_total"]


def _aborts(m: dict) -> float:
    return m.get('moeflow_requests_finished_total{finish_reason="abort"}', 0.0)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request_and_frees_its_blocks(server, stream):
    before = _settled(server)
    body = {"prompt": "a long one", "max_tokens": 480, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens, then hang up mid-stream
        assert sum(x.startswith("data: ") for x in got) >= 3
    else:
        # gives up while the request runs, closing the connection (at 0.5 s a fast CPU had decoded all 480)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.1)
    m = _settled(server)
    assert _aborts(m) == _aborts(before) + 1
    assert m["moeflow_kv_blocks_free"] == m["moeflow_kv_blocks_total"]
    produced = m["moeflow_generation_tokens_total"] - before["moeflow_generation_tokens_total"]
    assert produced < 480  # cancelled, not run to the end
