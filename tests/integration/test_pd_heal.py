"""One-command pd behind ``moeflow serve`` heals per instance: a worker of the decode instance is
SIGKILLed under load; the requests decoding there end with errors within 5 s (none hangs), the
prefill instance is not rebuilt, the decode instance is, and the deployment serves again (its
blocks and staging arena whole) without a restart of the whole deployment."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from server_harness import ServerProcess
from test_server_self_heal import _one, _segments


def test_a_dead_decode_instance_is_rebuilt_alone(checkpoints, tmp_path):
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "pd", "--prefill", "mode=colocated",
                      "--decode", "mode=afd,attn_workers=1,ffn_workers=1", "--dtype", "float32",
                      "--max-restarts", "2", log_path=str(tmp_path / "server.log"))
    try:
        victim = s.worker_pids()[-1]  # the prefill instance is in process: every worker is the decode instance's

        async def load_then_kill():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                flowing = asyncio.Event()
                first = [asyncio.ensure_future(_one(c, i % 2 == 0, flowing)) for i in range(4)]
                await asyncio.wait_for(flowing.wait(), 60)
                t_kill = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                results = await asyncio.gather(*first)
                ended_s = max(r["end"] for r in results) - t_kill
                seen, whole_s = [], None
                while time.monotonic() - t_kill < 60:
                    h = (await c.get("/health")).json()
                    seen.append(h["status"])
                    r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
                    if r.status_code == 200 and h["status"] == "ok":
                        whole_s = time.monotonic() - t_kill
                        break
                    await asyncio.sleep(0.1)
                return results, ended_s, seen, whole_s

        results, ended_s, seen, whole_s = asyncio.run(load_then_kill())
        errors = [r for r in results if r["error"] is not None]
        # each names the dead instance or worker (a request mid-handoff: its recompute found the worker gone)
        assert errors and all(any(m in r["error"]["message"] for m in ("decode instance 0 failed", "died",
                                                                       "exited unexpectedly"))
                              for r in errors), results
        assert ended_s < 5, results
        print(f"pd: requests ended {ended_s:.2f} s after the kill; whole again after {whole_s} s; /health said "
              f"{sorted(set(seen))}")
        assert whole_s is not None and "restarting" not in seen, (seen, s.log())
        m = s.metrics()
        assert m['moeflow_engine_restarts_total{result="ok"}'] == 1 and m["moeflow_degraded"] == 0, m
        assert m["moeflow_kv_transfers_in_flight"] == 0
    finally:
        assert s.stop() in (0, 143), s.log()
    assert _segments(s.proc.pid) == []
