"""``moeflow serve`` through the official ``openai`` client and raw HTTP: completions, chat,
streaming with usage, /v1/models, /health, /metrics, and a 4xx naming the problem for every kind
of malformed request (after which the server still serves)."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from server_harness import ServerProcess

NAME = "moe-test"
CONTEXT = 64


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_api") / "server.log"
    s = ServerProcess(checkpoints("qwen3").path, "--served-model-name", NAME, "--max-model-len", str(CONTEXT),
                      "--max-body-bytes", "65536", log_path=str(log))
    yield s
    assert s.stop() in (0, 143), s.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion(client):
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == NAME
    assert out.choices[0].finish_reason == "length" and isinstance(out.choices[0].text, str)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 5, 10)
    again = client.completions.create(model=NAME, prompt=list(b"Hello"), max_tokens=5, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # token ids = the byte tokenizer's ids: same greedy text


def test_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"  # the plain template (no tokenizer template)
    assert out.usage.prompt_tokens == len(prompt.encode()) and out.usage.completion_tokens == 4


def test_streaming_completion_matches_and_ends_with_usage(client):
    ref = client.completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.id == chunks[0].id for c in chunks) and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.total_tokens == 11 and all(c.usage is None for c in chunks[:-1])


def test_streaming_chat(client):
    msgs = [{"role": "user", "content": "Hi"}]
    ref = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 6
    plain = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "got 0" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (route, body, status, param, words the message must contain)
MALFORMED = [
    (C, b'{"prompt": "hi",', 400, None, ["not valid JSON"]),
    (C, b"", 400, None, ["JSON body"]),
    (C, b"[1, 2]", 400, None, []),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", ["valid integer"]),
    (C, {"prompt": 5}, 400, "prompt", ["expected one of str, list[int]", "got int"]),
    (C, {}, 400, "prompt", ["required"]),
    (CHAT, {"messages": "hi"}, 400, "messages", []),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", ["role"]),
    (C, {"model": "nope", "prompt": "hi"}, 404, "model", ["nope"]),
    (C, {"prompt": ""}, 400, "prompt", ["empty"]),
    (C, {"prompt": []}, 400, "prompt", ["empty"]),
    (CHAT, {"messages": []}, 400, "messages", ["at least one"]),
    (C, {"prompt": "x" * 100}, 400, "prompt", ["100 tokens", f"context of {CONTEXT}"]),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 100}]}, 400, "messages", [f"context of {CONTEXT}"]),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ["got 0"]),
    (C, {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ["got -3"]),
    (C, {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", ["1000", f"context of {CONTEXT}"]),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", ["got 0"]),
    (CHAT, {"messages": USER, "max_completion_tokens": 90}, 400, "max_completion_tokens", ["context of"]),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature", ["-1"]),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", ["1.5"]),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k", ["-5"]),
    (C, {"prompt": "hi", "seed": 2**70}, 400, "seed", ["seed"]),
    (C, {"prompt": [1, 999]}, 400, "prompt", ["999", "vocabulary"]),
    (C, {"prompt": "hi", "n": 129}, 400, "n", ["n=129", "limit of 128"]),
    (C, {"prompt": "hi", "echo": True}, 400, "echo", ["not supported"]),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}], "tool_choice": "auto"}, 400, "tools", ["tool"]),
    (C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", ["token ids"]),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", ["101"]),
    (C, {"prompt": ["a", "b"]}, 400, "prompt", ["batch of 2"]),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", ["stream=true"]),
    (C, {"prompt": "x" * 70000}, 413, None, ["70014 bytes", "65536"]),
]


@pytest.mark.parametrize("route,body,status,param,words", MALFORMED,
                         ids=[f"{i}-{m[2]}-{m[3]}" for i, m in enumerate(MALFORMED)])
def test_malformed_requests_get_a_4xx_naming_the_problem(server, route, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + route, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def test_chunked_oversized_body_is_refused(server):
    def body():  # no Content-Length: the limit counts what arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'
    r = httpx.post(server.url + C, content=body(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


# Far larger than the socket buffers: a server that answered and closed without reading it would
# reset the connection while the client is still writing (urllib then saw a broken pipe, not the 413).
BIG_BODY = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'


def _chunks(body: bytes, size: int = 1 << 16):
    return (body[i:i + size] for i in range(0, len(body), size))


def _post_urllib(url: str, chunked: bool, tmp_path) -> tuple[int, bytes]:
    data = _chunks(BIG_BODY) if chunked else BIG_BODY  # an iterable without a length goes out chunked
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post_requests(url: str, chunked: bool, tmp_path) -> tuple[int, bytes]:
    requests = pytest.importorskip("requests")
    r = requests.post(url, data=_chunks(BIG_BODY) if chunked else BIG_BODY,
                      headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.content


def _post_httpx(url: str, chunked: bool, tmp_path) -> tuple[int, bytes]:
    r = httpx.post(url, content=_chunks(BIG_BODY) if chunked else BIG_BODY,
                   headers={"Content-Type": "application/json"}, timeout=60)
    return r.status_code, r.content


def _post_curl(url: str, chunked: bool, tmp_path, expect: bool = True) -> tuple[int, bytes]:
    path = tmp_path / "body.json"
    path.write_bytes(BIG_BODY)
    headers = ["-H", "Content-Type: application/json"]
    headers += ["-H", "Transfer-Encoding: chunked"] if chunked else []
    headers += [] if expect else ["-H", "Expect:"]  # curl waits for "100 Continue" before a large body unless told not to
    res = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *headers, "--data-binary", f"@{path}", url],
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    body, _, status = res.stdout.rpartition(b"\n")
    return int(status), body


def _post_curl_no_expect(url: str, chunked: bool, tmp_path) -> tuple[int, bytes]:
    return _post_curl(url, chunked, tmp_path, expect=False)


CLIENTS = {"urllib": _post_urllib, "requests": _post_requests, "httpx": _post_httpx, "curl": _post_curl,
           "curl-no-expect": _post_curl_no_expect}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("client", list(CLIENTS))
def test_oversized_body_413_reaches_every_client(server, client, chunked, tmp_path):
    status, body = CLIENTS[client](server.url + C, chunked, tmp_path)
    assert status == 413, body[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "body_too_large" and "65536" in err["message"], err


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/expert_distribution")  # colocated: one process, no expert devices
    assert r.status_code == 404 and "records no expert load" in r.json()["error"]["message"]
    r = httpx.get(server.url + C)
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"  # RFC 9110: say which


def test_the_schema_states_what_the_server_refuses(server):
    """An empty prompt or message list is refused (above); the OpenAPI schema says so, so that a client
    generated from it (or a fuzzer) does not send what is bound to fail."""
    spec = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    prompt, messages = spec["CompletionRequest"]["properties"]["prompt"], spec["ChatCompletionRequest"]["properties"]
    assert prompt["minLength"] == 1 and prompt["minItems"] == 1 and messages["messages"]["minItems"] == 1


def test_still_serving_and_metrics_after_the_errors(server, client):
    out = client.completions.create(model=NAME, prompt="ok", max_tokens=3)
    assert out.usage.completion_tokens == 3
    m = server.metrics()
    assert m["moeflow_healthy"] == 1 and m["moeflow_requests_pending"] == 0
    assert m["moeflow_requests_running"] == 0 and m["moeflow_requests_waiting"] == 0
    assert m['moeflow_requests_running_per_group{group="0"}'] == 0
    assert m["moeflow_kv_blocks_free"] == m["moeflow_kv_blocks_total"] > 0
    assert m["moeflow_time_to_first_token_seconds_count"] >= 6
    assert m["moeflow_inter_token_latency_seconds_count"] >= 20
    assert m['moeflow_requests_finished_total{finish_reason="length"}'] >= 6
    assert m['moeflow_http_errors_total{status="400"}'] >= 20
    assert 0 < m['moeflow_worker_busy_fraction{worker="colocated"}'] <= 1


@pytest.mark.parametrize("args,words", [
    (["--model", "/no/such/model"], ["config.json not found"]),
    (["--mode", "asap", "--trace", "t.json"], ["--trace"]),
    (["--mode", "dep", "--init-expert-location", "/no/such.json"], ["'/no/such.json' is neither 'trivial' nor a file"]),
])
def test_serve_refuses_bad_setups_with_exit_2(checkpoints, args, words):
    res = subprocess.run([sys.executable, "-m", "moeflow", "serve", "--model", checkpoints("qwen3").path, *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("moeflow: error:"), res.stderr
    assert all(w in res.stderr for w in words)
