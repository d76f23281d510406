"""``moeflow serve --autoscale``: the controller resizes an afd deployment from its live load while
requests keep coming, every request is answered with colocated's output, and its decisions are in
/metrics."""
from __future__ import annotations

import concurrent.futures
import time

import httpx

from moeflow import LLM, SamplingParams

from server_harness import ServerProcess


def test_the_server_grows_an_afd_deployment_whose_tpot_is_over_its_slo(checkpoints, tmp_path):
    path = checkpoints("qwen3").path
    policy = tmp_path / "policy.yaml"
    # an SLO no step meets: every window is over it, so the controller grows the side the model says
    policy.write_text("tpot_slo_s: 0.0001\nmax_attention: 2\nmin_ffn: 2\nmax_ffn: 3\ninterval_s: 1.0\nwindow: 2\n"
                      "sample_s: 0.5\n")  # min_ffn 2: an idle start does not shrink it first
    prompts = [[(7 * i + j) % 200 for j in range(5 + i % 7)] for i in range(24)]
    with LLM(path, dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    server = ServerProcess(path, "--mode", "afd", "--topology", "all", "--attn-workers", "1", "--max-attn-workers",
                           "2", "--ffn-workers", "2", "--max-ffn-workers", "3", "--dtype", "float32",
                           "--served-model-name", "m", "--autoscale", str(policy), log_path=str(tmp_path / "s.log"))
    try:
        def complete(i: int) -> list[int]:
            time.sleep(0.25 * i)  # arrivals spread over 6 s, while the controller decides
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True})
            assert r.status_code == 200, r.text
            return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, range(len(prompts))))
        assert got == want
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/scale", timeout=30).json()["in_progress"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        m = server.metrics()
        grew = m['moeflow_members{role="attention"}'] + m['moeflow_members{role="ffn"}']
        assert m.get('moeflow_autoscale_decisions_total{reason="over_slo"}', 0) >= 1 and grew > 3, m
        assert "autoscale: over_slo" in server.log()
    finally:
        server.stop()
