"""``moeflow serve --autoscale``: the controller resizes an afd deployment from its live load while
requests keep coming, every request is answered with colocated's output, and its decisions are in
/metrics."""
from __future__ import annotations

import concurrent.futures
import re
import time

import httpx

from moeflow import LLM, SamplingParams

from server_harness import ServerProcess

HOLD_S = 3.0


def test_the_server_grows_an_afd_deployment_whose_tpot_is_over_its_slo(checkpoints, tmp_path):
    path = checkpoints("qwen3").path
    policy = tmp_path / "policy.yaml"
    # an SLO no step meets: every window is over it, so the controller grows the side the model says
    policy.write_text("tpot_slo_s: 0.0001\nmax_attention: 2\nmin_ffn: 2\nmax_ffn: 3\ninterval_s: 1.0\nwindow: 2\n"
                      f"sample_s: 0.5\nhold_s: {HOLD_S}\n")  # min_ffn 2: an idle start does not shrink it first
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
        # the load stops: idle, it gives members back, but never, within the hold, to a membership it left
        # for falling short (nor one with fewer members on both sides)
        while not any(e["after"] < e["before"] for e in httpx.get(server.url + "/scale", timeout=30).json()["events"]):
            assert time.monotonic() < deadline + 30, "no member was given back once the load stopped"
            time.sleep(0.2)
        # the controller's decisions with their times (engine clock) and the membership each left
        decisions = [(float(t), why, (int(a), int(n)), (int(fa), int(fn))) for why, a, n, t, fa, fn in re.findall(
            r"autoscale: (\w+) -> attention (\d+), ffn (\d+) .*? at ([\d.]+) from \{'attention': (\d+), 'ffn': (\d+)",
            server.log())]
        short = [(t, left) for t, why, _, left in decisions if why in ("over_slo", "ttft", "kv_room")]
        shrinks = [(t, to) for t, why, to, _ in decisions if why in ("under_slo", "idle")]
        assert short and shrinks, decisions
        for t, to in shrinks:
            assert not any(0 <= t - t0 < HOLD_S and to[0] <= a and to[1] <= n for t0, (a, n) in short), decisions
    finally:
        server.stop()
