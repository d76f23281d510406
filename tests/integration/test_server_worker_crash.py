"""A worker SIGKILLed under ``moeflow serve --mode asap`` or ``--mode afd`` with restarts off and the server kept up
(``--max-restarts 0 --keep-alive-on-failure``; without the latter it exits with status 3, test_server_self_heal.py):
the requests in flight get errors (500, or an error event on a stream), /health turns 503, new requests get 503 —
never a hung connection. With restarts on (the default) see test_server_self_heal.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from server_harness import ServerProcess


# the expert side (MoE worker, FFN daemon) is started first: the lower pid
MODES = {"asap": ["--attn-dp", "1", "--moe-workers", "1"], "afd": ["--attn-workers", "1", "--ffn-workers", "1"]}


@pytest.fixture(params=["asap", pytest.param("afd", marks=pytest.mark.slow)])  # afd's: make test-slow
def server(checkpoints, tmp_path, request):
    s = ServerProcess(checkpoints("qwen3").path, "--mode", request.param, *MODES[request.param],
                      "--dtype", "float32", "--max-restarts", "0", "--keep-alive-on-failure",
                      log_path=str(tmp_path / "server.log"))
    pids = s.worker_pids()
    assert len(pids) == 2, s.log()
    yield s, pids
    assert s.stop() in (0, 143), s.log()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), "a worker outlived the server"


def _assert_unavailable(s: ServerProcess) -> None:
    h = httpx.get(s.url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["status"] == "unhealthy" and "exited unexpectedly" in h.json()["reason"]
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert s.metrics()["moeflow_healthy"] == 0


async def _until_running(c: httpx.AsyncClient, n: int, timeout_s: float = 10.0) -> None:
    """Until the server has ``n`` requests admitted (on a loaded machine the plain request can
    still be on its way when the stream's third token arrives)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await c.get("/metrics")).text
        m = re.search(r"^moeflow_requests_running (\S+)$", text, re.M)
        if m and float(m.group(1)) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {n} requests admitted after {timeout_s} s")


async def _in_flight_then_kill(url: str, victim: int):
    """One plain and one streamed request running when ``victim`` is killed; both must end."""
    body = {"prompt": "a long generation", "max_tokens": 400, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:  # a hang would time out, failing the test
        plain = asyncio.ensure_future(c.post("/v1/completions", json=body))
        events = []
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:  # tokens are flowing: kill once the plain one is admitted too
                        await _until_running(c, 2)
                        os.kill(victim, signal.SIGKILL)
        return await plain, events


def test_killed_worker_fails_requests_in_flight_and_health(server):
    s, pids = server
    assert httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    victim = min(pids)  # the MoE worker / FFN daemon: it is started first
    t0 = time.monotonic()
    plain, events = asyncio.run(_in_flight_then_kill(s.url, victim))
    assert time.monotonic() - t0 < 25
    assert plain.status_code == 500, plain.text
    err = plain.json()["error"]
    assert err["code"] == "engine_failed" and f"pid {victim}" in err["message"]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "engine_failed" and f"pid {victim}" in last["error"]["message"]
    _assert_unavailable(s)


def test_worker_killed_while_idle_turns_health_unhealthy(server):
    s, pids = server
    os.kill(max(pids), signal.SIGKILL)  # the attention worker / instance
    deadline = time.monotonic() + 10
    while httpx.get(s.url + "/health").status_code == 200:
        assert time.monotonic() < deadline, "/health still reports healthy"
        time.sleep(0.05)
    _assert_unavailable(s)
