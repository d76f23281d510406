"""``moeflow bench serve`` end to end in a subprocess: a short fixed workload on colocated, then
``bench plot`` over its JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

POINT_KEYS = {"rps", "completed", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "prefill_tok_s", "buckets"}


def test_bench_serve_colocated_smoke(checkpoints, tmp_path):
    env = {**os.environ, "MOEFLOW_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "moeflow", "bench", "serve", "--model", checkpoints("qwen3").path,
           "--dtype", "float32", "--workload", "fixed", "--fixed-len", "16", "--request-rate", "3",
           "--duration-s", "2", "--slo-ttft-s", "5", "--json", str(out), "--plot", str(png), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "rate 3 rps:" in res.stdout and "TTFT mean" in res.stdout

    data = json.loads(out.read_text())
    assert set(data) >= {"mode", "config", "workload", "slo_ttft_s", "slo_rps", "points"}
    assert data["mode"] == "colocated" and data["slo_ttft_s"] == 5.0 and data["slo_rps"] is None
    assert data["workload"]["kind"] == "fixed" and data["workload"]["fixed_len"] == 16
    (p,) = data["points"]
    assert set(p) >= POINT_KEYS
    # the same seeded workload the command replayed: every request completed
    from moeflow.measure.workload import WorkloadConfig, generate_requests

    expected = len(generate_requests(WorkloadConfig(kind="fixed", fixed_len=16, rate_rps=3.0, duration_s=2.0)))
    assert p["completed"] == expected > 0 and p["rejected"] == 0 and p["failed"] == 0
    assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"] and p["prefill_tok_s"] > 0
    assert sum(b["count"] for b in p["buckets"]) == expected
    assert png.stat().st_size > 0

    png2 = tmp_path / "both.png"
    res = subprocess.run([sys.executable, "-m", "moeflow", "bench", "plot", str(out), str(out), "--out", str(png2)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert png2.stat().st_size > 0
