"""``python -m moeflow generate`` end to end, in a subprocess."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.fixture
def run_cli(tmp_path):
    env = {**os.environ, "MOEFLOW_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moeflow", *args], capture_output=True, text=True,
                              env=env, timeout=120)

    return run


def test_generate_prints_output_and_timings(checkpoints, run_cli):
    ck = checkpoints("qwen3")  # vocab 300 >= 258: the byte-level tokenizer fallback applies
    res = run_cli("generate", "--model", ck.path, "--prompt", "hi", "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "prompt (2 tokens): 'hi'" in out
    assert "output (4 tokens, finish_reason=length)" in out
    ids = re.search(r"token ids: \[(.*)\]", out).group(1)
    assert len(ids.split(",")) == 4
    assert re.search(r"model load [\d.]+ s \| TTFT [\d.]+ ms \| decode [\d.]+ tok/s \| total [\d.]+ s", out), out


def test_bad_model_path_exits_2_with_a_clear_message(tmp_path, run_cli):
    missing = str(tmp_path / "no-such-model")
    res = run_cli("generate", "--model", missing, "--prompt", "hi")
    assert res.returncode == 2
    assert res.stderr.startswith("moeflow: error:")
    assert missing in res.stderr and "config.json not found" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_sampling_argument_exits_2(checkpoints, run_cli):
    res = run_cli("generate", "--model", checkpoints("qwen3").path, "--prompt", "hi", "--max-tokens", "0")
    assert res.returncode == 2
    assert "max_tokens" in res.stderr and "Traceback" not in res.stderr


def test_generate_asap_writes_a_trace(checkpoints, run_cli, tmp_path):
    trace = tmp_path / "t.json"
    res = run_cli("generate", "--model", checkpoints("qwen3").path, "--prompt", "hi", "--max-tokens", "3",
                  "--mode", "asap", "--attn-dp", "1", "--moe-workers", "2", "--trace", str(trace))
    assert res.returncode == 0, res.stderr
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert tracks == {"attention0", "moe0", "moe1"}
    assert any(e.get("name") == "experts" for e in events)


def test_bench_experts_reports_an_inflection(checkpoints, run_cli, tmp_path):
    out = tmp_path / "e.json"
    res = run_cli("bench", "experts", "--model", checkpoints("qwen3").path, "--dtype", "float32",
                  "--repeats", "1", "--json", str(out))
    assert res.returncode == 0, res.stderr
    import json

    data = json.loads(out.read_text())
    assert data["inflection_tokens"] in [p["tokens"] for p in data["points"]]


@pytest.mark.parametrize("shape", [("--heads", "4", "--kv-heads", "2", "--head-dim", "32"), ("--model", "tiny-mla")])
def test_bench_decode_attention_reports_both_paths_against_the_bound(run_cli, tmp_path, shape):
    import json

    out = tmp_path / "d.json"
    res = run_cli("bench", "decode-attention", *shape, "--context", "40", "--batch", "2", "--block-size", "16",
                  "--dtype", "float32", "--repeats", "2", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "of bound" in res.stdout
    data = json.loads(out.read_text())
    assert data["provenance"]["commit"] and data["dtype"] == "float32" and data["batch"] == 2
    assert data["shape"]["latent"] == (shape[1] == "tiny-mla")
    (p,) = data["points"]
    assert p["context"] == 40 and p["kv_bytes"] > 0 and p["copy_gbps"] > 0 and p["bound_s"] > 0
    paths = ["gather"] + (["kernel"] if data["kernel"]["available"] else [])
    for path in paths:
        assert p[path]["seconds"] > 0 and p[path]["fraction_of_bound"] > 0 and p[path]["gbps"] > 0
    if data["kernel"]["available"]:
        assert p["speedup"] > 0 and p["max_abs_diff"] < 1e-4


def test_the_api_key_comes_from_the_environment(monkeypatch):
    from moeflow import settings

    monkeypatch.delenv("MOEFLOW_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert settings.api_key() is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert settings.api_key() == "v"
    monkeypatch.setenv("MOEFLOW_API_KEY", "m")  # ours first
    assert settings.api_key() == "m"


def test_bench_serve_takes_its_rate_as_request_rate_only(run_cli):
    # one flag for the rate (vllm bench serve's spelling): --rps is gone, and over HTTP it is one rate
    res = run_cli("bench", "serve", "--rps", "1")
    assert res.returncode == 2 and "unrecognized arguments: --rps" in res.stderr
    res = run_cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1,2", "--num-prompts", "2")
    assert res.returncode == 2 and "over HTTP one rate per run" in res.stderr
