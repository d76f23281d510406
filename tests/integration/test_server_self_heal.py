"""``moeflow serve`` heals itself: a MoE worker, then an attention worker, SIGKILLed under load. Each
time the requests in flight end with errors within 5 s, none hangs and none is lost (every request
gets a complete answer or an error), requests that arrive while the deployment is rebuilt get 503
with Retry-After, /health is 200 again within a measured time, the restarts are counted on
/metrics, and after shutdown no process and no /dev/shm segment of the server is left. Two
restarts that both brought the deployment up do not spend ``--max-restarts 1``; a deployment that
cannot come back ends the server with status 3. A dwdp rank killed under load is replaced in
place while the other serves; a stopped worker is found by the stall watchdog and healed.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from server_harness import ServerProcess


BODY = {"prompt": "a long generation", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
HEAL_LIMIT_S = 90.0  # generous for a loaded 2-core machine; the measured time is printed


def _segments(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"moeflow-{pid}-"))


def _deployments(pid: int) -> set[str]:
    return {n.split(".")[0] for n in _segments(pid)}


async def _one(c: httpx.AsyncClient, stream: bool, tokens_flowing: asyncio.Event) -> dict:
    """One request to its end: how it ended and when."""
    if not stream:
        r = await c.post("/v1/completions", json=BODY)
        out = r.json()
        return {"status": r.status_code, "error": out.get("error"), "end": time.monotonic(),
                "finish": out["choices"][0]["finish_reason"] if r.status_code == 200 else None}
    events = []
    async with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                tokens_flowing.set()
    last = json.loads(events[-2]) if len(events) >= 2 else {}
    return {"status": r.status_code, "error": last.get("error"), "end": time.monotonic(), "done": events[-1:] == ["[DONE]"],
            "finish": (last.get("choices") or [{}])[0].get("finish_reason")}


async def _kill_under_load(url: str, victim: int, n: int = 6) -> tuple[float, list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:  # a hang times out and fails the test
        flowing = asyncio.Event()
        tasks = [asyncio.ensure_future(_one(c, i % 2 == 0, flowing)) for i in range(n)]
        await asyncio.wait_for(flowing.wait(), 60)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return t_kill, await asyncio.gather(*tasks)


def _wait_healed(s: ServerProcess, t_kill: float) -> tuple[float, set[str], list[str]]:
    """Poll until a request succeeds again; the /health statuses and Retry-After headers seen meanwhile."""
    health, retry_after = set(), []
    while True:
        assert time.monotonic() - t_kill < HEAL_LIMIT_S, f"not serving {HEAL_LIMIT_S} s after the kill:\n{s.log()}"
        h = httpx.get(s.url + "/health", timeout=10)
        health.add(h.json()["status"])
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        if r.status_code == 200:
            return time.monotonic() - t_kill, health, retry_after
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        if "retry-after" in r.headers:
            retry_after.append(r.headers["retry-after"])
        time.sleep(0.05)


def test_the_server_replaces_killed_workers_under_load(checkpoints, tmp_path):
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1",
                      "--dtype", "float32", "--max-restarts", "1", "--restart-backoff-s", "0.5",
                      log_path=str(tmp_path / "server.log"))  # 1: two restarts that both come up spend nothing
    seen_pids = set()
    try:
        for round_, pick in enumerate((min, max)):  # the MoE worker (started first), then the attention worker
            pids = s.worker_pids()
            assert len(pids) == 2, s.log()
            seen_pids |= set(pids)
            victim = pick(pids)
            t_kill, results = asyncio.run(_kill_under_load(s.url, victim))
            for r in results:  # every request answered: an error naming the dead worker, or a whole completion
                if r["error"] is not None:
                    assert r["error"]["code"] == "engine_failed" and f"pid {victim}" in r["error"]["message"], r
                    assert r["end"] - t_kill < 5.0, f"an affected request ended {r['end'] - t_kill:.1f} s after the kill"
                else:
                    assert r["status"] == 200 and r["finish"] == "length", r
                assert r.get("done", True), r
            assert any(r["error"] for r in results), "the kill affected no request"
            heal_s, health, retry_after = _wait_healed(s, t_kill)
            print(f"round {round_}: serving again {heal_s:.1f} s after killing pid {victim}")
            assert "restarting" in health and retry_after, (health, retry_after)
            assert httpx.get(s.url + "/health").status_code == 200
            assert len(_deployments(s.proc.pid)) == 1, _segments(s.proc.pid)  # the dead deployment's are gone
            ok = httpx.post(s.url + "/v1/completions", json={**BODY, "max_tokens": 8}, timeout=30)
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        m = s.metrics()
        restarts = {k: v for k, v in m.items() if "restart" in k}
        assert m.get('moeflow_engine_restarts_total{result="ok"}') == 2 and m["moeflow_healthy"] == 1, restarts
        assert m["moeflow_engine_restart_seconds_count"] == 2, restarts
        seen_pids |= set(s.worker_pids())
    finally:
        code = s.stop()
    assert code in (0, 143), s.log()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in seen_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in seen_pids if os.path.exists(f"/proc/{p}")], "a worker outlived the server"
    assert _segments(s.proc.pid) == []


def test_the_server_exits_when_the_deployment_cannot_come_back(checkpoints, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(checkpoints("qwen3").path, model)
    s = ServerProcess(str(model), "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1", "--dtype", "float32",
                      "--max-restarts", "1", "--restart-backoff-s", "0.1", log_path=str(tmp_path / "server.log"))
    try:
        shutil.rmtree(model)  # every rebuild fails now: the checkpoint is gone
        os.kill(min(s.worker_pids()), signal.SIGKILL)
        code = s.proc.wait(timeout=60)  # a supervisor would restart it now
    finally:
        s.stop()
    log = s.log()
    assert code == 3, log
    assert "1 restart attempt(s) in a row failed to bring it back" in log and "config.json not found" in log, log
    assert "exiting with status 3" in log, log
    assert _segments(s.proc.pid) == []


def _pids_by_rank(s: ServerProcess) -> list[int]:
    return sorted(s.worker_pids())  # spawned in rank order


def test_a_killed_dwdp_rank_is_replaced_in_place_under_load(checkpoints, tmp_path):
    """The other rank never stops serving: /health says "degraded" until the replacement is ready,
    within 10 s of the kill (the server used to run on one rank, "ok", until the load stopped)."""
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "dwdp", "--dp", "2", "--dtype", "float32",
                      "--max-restarts", "2", log_path=str(tmp_path / "server.log"))
    try:
        old = _pids_by_rank(s)
        assert len(old) == 2, s.log()

        async def load_then_kill():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                flowing = asyncio.Event()
                first = [asyncio.ensure_future(_one(c, True, flowing)) for _ in range(4)]
                await asyncio.wait_for(flowing.wait(), 60)
                t_kill = time.monotonic()
                os.kill(old[1], signal.SIGKILL)
                seen, whole_s, served = [], None, 0
                while time.monotonic() - t_kill < 30:  # keep loading while it heals
                    r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
                    served += r.status_code == 200
                    h = (await c.get("/health")).json()
                    seen.append(h["status"])
                    if h["status"] == "ok" and "degraded" in seen:
                        whole_s = time.monotonic() - t_kill
                        break
                return t_kill, await asyncio.gather(*first), seen, whole_s, served

        t_kill, results, seen, whole_s, served = asyncio.run(load_then_kill())
        errors = [r for r in results if r["error"] is not None]
        messages = [r["error"]["message"] for r in errors]
        assert errors and all("rank 1 failed" in m for m in messages), (messages, s.log())
        assert any(r["finish"] == "length" for r in results), results  # rank 0's requests completed
        print(f"dwdp: whole again {whole_s} s after killing rank 1; {served} requests served meanwhile; "
              f"/health said {sorted(set(seen))}")
        assert whole_s is not None and whole_s < 10, (seen, s.log())
        assert served >= 1 and "restarting" not in seen  # never down: no rebuild
        m = s.metrics()
        assert m['moeflow_engine_restarts_total{result="ok"}'] == 1 and m["moeflow_degraded"] == 0, m
        new = _pids_by_rank(s)
        assert new[0] == old[0] and new[1] != old[1], (old, new)
        before = m.get('moeflow_worker_busy_seconds_total{worker="rank1"}', 0.0)

        async def together(n: int = 6):  # at once, so that both ranks get some
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 16})
                                              for _ in range(n)))

        assert all(r.status_code == 200 for r in asyncio.run(together()))  # the replacement takes requests
        assert s.metrics()['moeflow_worker_busy_seconds_total{worker="rank1"}'] > before
    finally:
        assert s.stop() in (0, 143), s.log()
    assert _segments(s.proc.pid) == []


def test_a_stopped_worker_is_noticed_by_the_stall_watchdog_and_healed(checkpoints, tmp_path):
    """SIGSTOP of the MoE worker for longer than --stall-timeout-s: the requests in flight fail with a
    message naming the stall and the stopped process, /metrics counts it, and the rebuilt deployment
    serves (the server used to stall every request with /health 200 until SIGCONT)."""
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1",
                      "--dtype", "float32", "--stall-timeout-s", "3", "--restart-backoff-s", "0.1",
                      log_path=str(tmp_path / "server.log"))
    stopped = None
    try:
        stopped = min(s.worker_pids())  # the MoE worker: started first

        async def stop_under_load():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                flowing = asyncio.Event()
                tasks = [asyncio.ensure_future(_one(c, i % 2 == 0, flowing)) for i in range(2)]
                await asyncio.wait_for(flowing.wait(), 60)
                os.kill(stopped, signal.SIGSTOP)
                t0 = time.monotonic()
                return t0, await asyncio.gather(*tasks)

        t0, results = asyncio.run(stop_under_load())
        for r in results:
            assert r["error"] is not None and "stalled" in r["error"]["message"], r
            assert f"pid {stopped}" in r["error"]["message"] and "is stopped" in r["error"]["message"], r
            assert 3 <= r["end"] - t0 < 15, r["end"] - t0
        heal_s, health, _ = _wait_healed(s, t0)
        print(f"stalled worker: requests failed {max(r['end'] for r in results) - t0:.1f} s after SIGSTOP; "
              f"serving again after {heal_s:.1f} s")
        m = s.metrics()
        assert m["moeflow_engine_stalls_total"] == 1 and m['moeflow_engine_restarts_total{result="ok"}'] == 1, m
        assert stopped not in s.worker_pids()  # the stopped one was killed, not left behind
    finally:
        if stopped is not None and os.path.exists(f"/proc/{stopped}"):
            os.kill(stopped, signal.SIGCONT)
        assert s.stop() in (0, 143), s.log()
    assert _segments(s.proc.pid) == []
