"""``moeflow serve --autoscale``: the controller resizes an afd deployment (A:F), a pd deployment
(xPyD) and the ranks of dep and dwdp (EP size) from its live load while requests keep coming, every request is answered with colocated's
output, its decisions are in /metrics, and once the load stops it gives members back, never within the
hold to a membership it left short."""
from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from moeflow import LLM, SamplingParams

from server_harness import ServerProcess

HOLD_S = 3.0


def test_the_server_grows_an_afd_deployment_whose_tpot_is_over_its_slo(checkpoints, tmp_path):
    # an SLO no step meets: every window is over it, so the controller grows the side the model says
    server = _loaded(checkpoints, tmp_path, "tpot_slo_s: 0.0001\nmax_attention: 2\nmin_ffn: 2\nmax_ffn: 3\n"
                     f"interval_s: 1.0\nwindow: 2\nsample_s: 0.5\nhold_s: {HOLD_S}\n",  # min_ffn 2: no shrink first
                     "--mode", "afd", "--topology", "all", "--attn-workers", "1", "--max-attn-workers", "2",
                     "--ffn-workers", "2", "--max-ffn-workers", "3")
    try:
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


def test_the_server_resizes_a_pd_deployment_from_its_load_and_gives_instances_back_after(checkpoints, tmp_path):
    # a TPOT SLO no request meets (a decode instance more: the proportional model predicts a gain) and a
    # target utilization the prefill instance passes as soon as it computes (rate matching asks for another)
    server = _loaded(checkpoints, tmp_path, "tpot_slo_s: 0.0001\nttft_slo_s: 5\ntarget_utilization: 0.001\n"
                     f"max_prefill: 2\nmax_decode: 2\ninterval_s: 1.0\nwindow: 2\nsample_s: 0.5\nhold_s: {HOLD_S}\n",
                     "--mode", "pd", "--prefill", "mode=colocated", "--decode", "mode=colocated",
                     "--max-prefill-instances", "2", "--max-decode-instances", "2")
    try:
        deadline = time.monotonic() + 90
        while True:
            events = httpx.get(server.url + "/scale", timeout=30).json()["events"]
            if any(e["after"] < e["before"] and e["outcome"] == "done" for e in events):  # done while idle
                break
            assert time.monotonic() < deadline, f"no instance was given back once the load stopped: {events}"
            time.sleep(0.2)
        ups = {e["kind"] for e in events if e["after"] > e["before"] and e["outcome"] == "done"}
        assert ups == {"prefill", "decode"}, events
        decisions = [(float(t), why, (int(x), int(y)), (int(fx), int(fy))) for why, x, y, t, fx, fy in re.findall(
            r"autoscale: ([\w+]+) -> prefill (\d+), decode (\d+) .*? at ([\d.]+) from \{'prefill': (\d+), "
            r"'decode': (\d+)", server.log())]
        short = [(t, left) for t, why, _, left in decisions if set(why.split("+")) & {"prefill_rate_up", "over_slo"}]
        shrinks = [(t, to) for t, why, to, left in decisions if to[0] <= left[0] and to[1] <= left[1]]
        assert short and shrinks, decisions
        for t, to in shrinks:
            assert not any(0 <= t - t0 < HOLD_S and to[0] <= x and to[1] <= y for t0, (x, y) in short), decisions
        m = server.metrics()
        assert sum(v for k, v in m.items() if k.startswith("moeflow_autoscale_decisions_total")) >= len(decisions)
        assert m['moeflow_scale_events_total{kind="prefill",outcome="done"}'] >= 1, m
        assert m['moeflow_members{role="decode"}'] >= 1, m
    finally:
        server.stop()


@pytest.mark.parametrize("mode,flags", [("dep", ("--dp", "2", "--max-dp", "3")),
                                        ("dwdp", ("--dp", "1", "--max-dp", "2"))])
def test_the_server_resizes_the_ranks_of_a_dep_or_dwdp_deployment_and_gives_them_back_after(
        checkpoints, tmp_path, mode, flags):
    # a TPOT SLO no request meets: a rank more spreads the requests, and the expert load the test model
    # routes leaves the hottest device a gain (dep); once the load stops, idle, it gives the rank back
    most = int(flags[3])
    server = _loaded(checkpoints, tmp_path, f"tpot_slo_s: 0.0001\nmax_ranks: {most}\ninterval_s: 1.0\nwindow: 2\n"
                     f"sample_s: 0.5\nhold_s: {HOLD_S}\n", "--mode", mode, *flags)
    try:
        deadline = time.monotonic() + 90
        while True:
            events = httpx.get(server.url + "/scale", timeout=30).json()["events"]
            if any(e["after"] < e["before"] and e["outcome"] == "done" for e in events):
                break
            assert time.monotonic() < deadline, f"no rank was given back once the load stopped: {events}"
            time.sleep(0.2)
        assert any(e["after"] == most and e["outcome"] == "done" for e in events), events
        decisions = [(float(t), why, int(to), int(left)) for why, to, t, left in re.findall(
            r"autoscale: (\w+) -> ranks (\d+) .*? at ([\d.]+) from \{'ranks': (\d+)", server.log())]
        short = [(t, left) for t, why, _, left in decisions if why in ("over_slo", "ttft", "kv_room")]
        shrinks = [(t, to) for t, why, to, left in decisions if to < left]
        assert short and shrinks, decisions
        for t, to in shrinks:  # never within the hold back to a rank count it left short
            assert not any(0 <= t - t0 < HOLD_S and to <= left for t0, left in short), decisions
        assert server.metrics().get('moeflow_autoscale_decisions_total{reason="over_slo"}', 0) >= 1
    finally:
        server.stop()


def _loaded(checkpoints, tmp_path, policy: str, *flags: str) -> ServerProcess:
    """A server started with ``flags`` under ``--autoscale`` (``policy``: the POLICY.yaml), after a load of 24
    requests arriving over 6 s, every answer colocated's."""
    path = checkpoints("qwen3").path
    (tmp_path / "policy.yaml").write_text(policy)
    prompts = [[(7 * i + j) % 200 for j in range(5 + i % 7)] for i in range(24)]
    with LLM(path, dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    server = ServerProcess(path, *flags, "--dtype", "float32", "--served-model-name", "m", "--autoscale",
                           str(tmp_path / "policy.yaml"), log_path=str(tmp_path / "s.log"))
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda i: _complete(server, prompts, i), range(len(prompts)))) == want
    except BaseException:
        server.stop()
        raise
    return server


def _complete(server, prompts, i: int) -> list[int]:
    time.sleep(0.25 * i)  # arrivals spread over 6 s, while the controller decides
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
