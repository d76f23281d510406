"""Prefill and decode servers registered and deregistered behind a serving ``moeflow router``: under
concurrent load a second decode and a second prefill server join (and take requests), then the first
of each is deregistered mid-load, drains and leaves; every request is answered with colocated's
greedy text, nothing is left staged or allocated on any server, ``/metrics`` counts the events, the
``router-admin`` command does the same through the routes, and each refusal names its reason."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from server_harness import ServerProcess
from test_pd_router import COMMON, wait_clean
from test_pd_router_failures import PROMPTS, Split, expected


def _workers(router) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=10).json()["workers"]}


def _admin(router, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeflow", "router-admin", *args, "--router", router.url],
                          capture_output=True, text=True, timeout=120)


def test_servers_join_and_leave_under_load(checkpoints, tmp_path):
    path = checkpoints("qwen3").path
    want = expected(path, PROMPTS, max_tokens=12)
    split = Split(path, tmp_path)
    try:
        d2 = split._add(ServerProcess(path, "--role", "decode", *COMMON, log_path=str(tmp_path / "decode2.log")))
        p2 = split._add(ServerProcess(path, "--role", "prefill", *COMMON, log_path=str(tmp_path / "prefill2.log")))
        router, p1, d1 = split.router, split.prefill, split.decode
        answers: list = []
        load = threading.Thread(target=lambda: answers.extend(split.load(PROMPTS * 2, max_tokens=12, workers=8)))
        load.start()
        time.sleep(0.5)
        added = httpx.post(router.url + "/workers", json={"url": d2.url, "worker_type": "decode"}, timeout=60)
        assert added.status_code == 200 and added.json()["state"] == "serving", added.text
        add = _admin(router, "add", p2.url, "--role", "prefill")
        assert add.returncode == 0, add.stderr
        assert set(_workers(router)) == {p1.url, p2.url, d1.url, d2.url}
        time.sleep(1.0)
        gone = httpx.delete(f"{router.url}/workers/{d1.url}", timeout=10)
        assert gone.status_code == 202 and gone.json()["status"] in ("draining", "removed"), gone.text
        rm = _admin(router, "remove", p1.url, "--wait", "--timeout-s", "60")
        assert rm.returncode == 0, rm.stderr
        load.join(timeout=180)
        assert not load.is_alive()
        deadline = time.monotonic() + 30
        while set(_workers(router)) != {p2.url, d2.url}:
            assert time.monotonic() < deadline, _workers(router)
            time.sleep(0.1)
        assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers if a.status_code != 200]
        assert [a.json()["choices"][0]["text"] for a in answers] == want * 2
        # after the changes the router still answers, on the new pair only
        assert [a.json()["choices"][0]["text"] for a in split.load(PROMPTS[:8], max_tokens=12)] == want[:8]
        m = router.metrics()
        assert m['moeflow_router_membership_events_total{event="added"}'] == 2
        assert m['moeflow_router_membership_events_total{event="removed"}'] == 2
        assert m['moeflow_router_membership_events_total{event="drained"}'] == 2
        assert m['moeflow_router_servers{role="decode",state="serving"}'] == 1
        # the new servers took requests; the old ones took some before they left
        for s in (p1, p2):
            assert s.metrics()['moeflow_kv_transfer_seconds_count{path="in-place"}'] > 0, s.url
        wait_clean(p1, p2, d1, d2)
        # refusals, each with its reason
        last = httpx.delete(f"{router.url}/workers/{d2.url}", timeout=10)
        assert last.status_code == 409 and "last decode server" in last.json()["error"]["message"]
        assert httpx.delete(f"{router.url}/workers/http://127.0.0.1:1", timeout=10).status_code == 404
        dup = httpx.post(router.url + "/workers", json={"url": p2.url, "worker_type": "prefill"}, timeout=30)
        assert dup.status_code == 400 and "already registered" in dup.json()["error"]["message"]
        wrong = httpx.post(router.url + "/workers", json={"url": d1.url, "worker_type": "prefill"}, timeout=30)
        assert wrong.status_code == 400 and "is a decode server, given as --prefill" in wrong.json()["error"]["message"]
        bad = _admin(router, "add", d1.url, "--role", "prefill")
        assert bad.returncode == 1 and "is a decode server" in bad.stderr
        assert set(_workers(router)) == {p2.url, d2.url}
    finally:
        split.stop()
