"""``moeflow bench comm`` runs end to end and writes the documented JSON schema (tiny sizes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KEYS = {"tokens", "hidden", "receivers", "async_us", "p2p_us", "handshake_us", "async_sender_us", "p2p_sender_us",
        "speedup", "async_gbps", "memcpy_gbps"}


def test_bench_comm_smoke(tmp_path):
    out = tmp_path / "comm.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "moeflow", "bench", "comm", "--tokens", "16,64", "--hidden", "64",
           "--receivers", "1,2", "--rounds", "4", "--busy-rounds", "3", "--json", str(out)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4 and all(KEYS <= set(r) for r in result["rows"])
    assert all(r["async_us"] > 0 and r["speedup"] == pytest.approx(r["p2p_us"] / r["async_us"]) for r in result["rows"])
    assert {p["policy"] for p in result["policies"]} == {"adaptive", "yield", "block"}
    assert "speedup" in done.stdout and not [n for n in os.listdir("/dev/shm") if "moeflow-bench" in n]
