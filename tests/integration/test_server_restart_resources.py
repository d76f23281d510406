"""``moeflow serve`` holds no more descriptors or threads after its deployment has been rebuilt again
and again: the MoE worker of an asap deployment SIGKILLed, the server's own restart path rebuilding
it, each heal waited for, and the server's /proc/<pid>/fd and /proc/<pid>/task counted after a
warm-up restart and after the last. Each restart used to leave 4 pipes open (the two dead workers'
process objects, each holding its fork-server sentinel and a pipe end; issue 44: 17 -> 37
descriptors after six kills).

The loop talks to the server over one kept-alive connection and only to /health and /metrics: a
completion tokenizes on asyncio's default executor, which starts threads on demand (up to
min(32, CPUs + 4)) and would add threads that are not a leak. So both counts must come back to
their baseline exactly; a descriptor still closing (a connection torn down) gets a few seconds.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from server_harness import ServerProcess

HEAL_LIMIT_S = 90.0  # per kill, generous for a loaded 2-core machine
SETTLE_S = 3.0


def _counts(pid: int) -> tuple[int, int]:
    """(open descriptors, threads) of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _restarts_ok(c: httpx.Client) -> float:
    m = re.search(r'^moeflow_engine_restarts_total\{result="ok"\} (\S+)$', c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _kill_moe_worker_and_wait(s: ServerProcess, c: httpx.Client) -> float:
    """SIGKILL the MoE worker (started first: the lower pid); seconds until the server serves again."""
    pids = s.worker_pids()
    assert len(pids) == 2, s.log()
    victim, before = min(pids), _restarts_ok(c)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while _restarts_ok(c) < before + 1 or c.get("/health").status_code != 200:
        assert s.proc.poll() is None, s.log()
        assert time.monotonic() - t0 < HEAL_LIMIT_S, f"not healed {HEAL_LIMIT_S} s after the kill:\n{s.log()}"
        time.sleep(0.05)
    assert victim not in s.worker_pids()
    return time.monotonic() - t0


@pytest.mark.parametrize("kills", [5, pytest.param(20, marks=pytest.mark.slow)])
def test_restarts_leave_no_descriptor_or_thread_behind(checkpoints, tmp_path, kills):
    # backoff 0: kills seconds apart are a crash loop, whose doubling waits would dominate the runtime
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1",
                      "--dtype", "float32", "--restart-backoff-s", "0", log_path=str(tmp_path / "server.log"))
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            _kill_moe_worker_and_wait(s, c)  # warm-up: whatever the first restart sets up for good
            fds0, threads0 = _counts(s.proc.pid)
            heal_s = [_kill_moe_worker_and_wait(s, c) for _ in range(kills)]
            deadline = time.monotonic() + SETTLE_S
            while ((counts := _counts(s.proc.pid))[0] > fds0 or counts[1] > threads0) and time.monotonic() < deadline:
                time.sleep(0.1)
            print(f"{kills} restarts (heals {min(heal_s):.1f}-{max(heal_s):.1f} s): "
                  f"descriptors {fds0} -> {counts[0]}, threads {threads0} -> {counts[1]}")
            assert counts[0] <= fds0, f"{counts[0] - fds0} descriptors more after {kills} restarts"
            assert counts[1] <= threads0, f"{counts[1] - threads0} threads more after {kills} restarts"
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        assert s.stop() in (0, 143), s.log()
