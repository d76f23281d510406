"""Property-based fuzzing of the HTTP API: zero 5xx answers, and the server ends healthy and idle.

schemathesis derives request strategies from the server's own OpenAPI schema — bodies that fit
it (positive) and bodies that break it (negative) — and hypothesis drives them; a second test
throws arbitrary bytes at the POST routes. ``derandomize`` keeps CI reproducible; the context is
64 tokens so any generated request that is accepted finishes in well under a second.
"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import ServerProcess

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_fuzz") / "server.log"
    s = ServerProcess(checkpoints("qwen3").path, "--max-model-len", "64", "--max-body-bytes", "65536",
                      log_path=str(log))
    yield s
    assert s.stop() in (0, 143), s.log()


def _fuzz(strategy, url: str, seen: list) -> None:
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        r = case.call(base_url=url, timeout=30)
        seen.append(r.status_code)
        assert r.status_code < 500, f"{r.status_code} {r.text[:500]}\n{case.as_curl_command()}"

    run()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzzing_gets_no_5xx(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    seen: list[int] = []
    for result in schema.get_all_operations():
        op = result.ok()
        if mode == "negative" and op.method.upper() != "POST":
            continue  # the GET routes take no input to break
        _fuzz(op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)), server.url, seen)
    print(mode, {s: seen.count(s) for s in sorted(set(seen))})
    assert seen and all(s < 500 for s in seen)
    if mode == "positive":
        assert 200 in seen  # some generated requests really ran
    m = server.metrics()
    assert m["moeflow_healthy"] == 1 and m["moeflow_requests_pending"] == 0
    assert m["moeflow_kv_blocks_free"] == m["moeflow_kv_blocks_total"]


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.one_of(st.binary(max_size=200),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                                   lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
                                       st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p",
                                                        "top_k", "seed", "stream", "role", "content", "n"]),
                                       kids, max_size=5),
                                   max_leaves=12).map(lambda v: httpx.Request("POST", "/", json=v).content)))
def test_arbitrary_bodies_get_no_5xx(server, route, body):
    r = httpx.post(server.url + route, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
