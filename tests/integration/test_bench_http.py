"""``moeflow bench serve --base-url`` against a real ``moeflow serve`` (colocated, a small
checkpoint): the saved JSON carries vLLM's metric names and every request completed, with one
streamed chunk per output token. A dead URL fails fast on the initial test request."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from server_harness import ServerProcess, free_port

NAME = "moe-bench"


def _bench(url: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moeflow", "bench", "serve", "--base-url", url, "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def test_bench_serve_over_http(checkpoints, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = ServerProcess(checkpoints("qwen3").path, "--mode", "colocated", "--served-model-name", NAME,
                           log_path=str(tmp_path / "server.log"))
    try:
        res = _bench(server.url, "--served-model-name", NAME, "--workload", "fixed", "--fixed-len", "16",
                     "--num-prompts", "8", "--request-rate", "4", "--max-tokens", "4", "--goodput", "ttft:60000",
                     "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                     "--save-result", "--result-dir", str(tmp_path / "res"), "--result-filename", "r.json", env=env)
    finally:
        assert server.stop() in (0, 143), server.log()
    assert res.returncode == 0, res.stderr
    assert "Serving Benchmark Result" in res.stdout and "Mean TTFT (ms):" in res.stdout
    assert "Request goodput (req/s):" in res.stdout and "P50 E2EL (ms):" in res.stdout

    data = json.loads((tmp_path / "res" / "r.json").read_text())
    keys = {"duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "request_goodput", "output_throughput", "total_token_throughput", "request_rate", "burstiness",
            "max_concurrency", "input_lens", "output_lens", "ttfts", "itls", "errors"}
    keys |= {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
    assert keys <= set(data), keys - set(data)
    assert data["completed"] == 8 and data["failed"] == 0 and data["request_rate"] == 4.0
    assert data["total_input_tokens"] == 8 * 16 and data["output_lens"] == [4] * 8
    assert data["request_goodput"] == data["request_throughput"] > 0  # a 60 s SLO: every request is good
    assert [len(g) for g in data["itls"]] == [3] * 8  # one streamed chunk per token
    assert 0 < data["median_ttft_ms"] <= data["p99_ttft_ms"] <= data["p99_e2el_ms"]
    assert data["workload"]["kind"] == "fixed" and data["model_id"] == NAME


def test_bench_serve_dead_url_fails_fast(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    res = _bench(url, "--workload", "fixed", "--fixed-len", "4", "--num-prompts", "2", env=dict(os.environ))
    assert res.returncode == 1 and "initial test request" in res.stderr
