"""Separate prefill and decode servers behind ``moeflow router`` when things go wrong: 5% of KV copies
fail on both sides under concurrent load (SGLang's failure injection), a decode server refuses
(its pre-allocation queue is full), a client leaves mid-stream, a lease runs out while the decode
server has no room, a decode server dies. Every request ends with an answer or an explicit error,
nothing hangs, and both servers' blocks and staged ranges return to full (zero stranded)."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moeflow import LLM, SamplingParams

from server_harness import ServerProcess
from test_pd_router import COMMON, wait_clean

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(20 + i % 7)] for i in range(40)]


class Split:
    def __init__(self, path: str, logs, prefill=(), decode=(), env=None):
        self.servers = []
        try:
            self.prefill = self._add(ServerProcess(path, "--role", "prefill", *COMMON, *prefill, env=env,
                                                   log_path=str(logs / "prefill.log")))
            self.decode = self._add(ServerProcess(path, "--role", "decode", *COMMON, *decode, env=env,
                                                  log_path=str(logs / "decode.log")))
            self.router = self._add(ServerProcess(None, "--prefill", self.prefill.url, "--decode", self.decode.url,
                                                  log_path=str(logs / "router.log")))
        except BaseException:
            self.stop()
            raise

    def _add(self, s: ServerProcess) -> ServerProcess:
        self.servers.append(s)
        return s

    def complete(self, ids, max_tokens: int = 6, timeout_s: float = 60.0) -> httpx.Response:
        return httpx.post(self.router.url + "/v1/completions", timeout=timeout_s,
                          json={"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True})

    def load(self, prompts, max_tokens: int = 6, workers: int = 16) -> list[httpx.Response]:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda ids: self.complete(ids, max_tokens), prompts))

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()


@pytest.fixture
def path(checkpoints):
    return checkpoints("qwen3").path


def expected(path: str, prompts, max_tokens: int = 6) -> list[str]:
    with LLM(path, dtype="float32") as ref:
        return [o.outputs[0].text for o in ref.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                                ignore_eos=True))]


def test_injected_copy_failures_under_load(path, tmp_path):
    """5% of copies fail on each side; under recompute every answer is the reference's."""
    split = Split(path, tmp_path, env={"MOEFLOW_PD_FAIL_PROB": "0.05"})
    try:
        answers = split.load(PROMPTS)
        assert [r.status_code for r in answers] == [200] * len(PROMPTS)
        assert [r.json()["choices"][0]["text"] for r in answers] == expected(path, PROMPTS)
        pm, dm = split.prefill.metrics(), split.decode.metrics()
        failed = pm.get('moeflow_kv_handoffs_given_up_total{outcome="failures"}', 0) + \
            dm.get('moeflow_kv_handoffs_given_up_total{outcome="failures"}', 0)
        assert failed > 0  # the injection hit some copies: they were recomputed on the decode server
        assert dm['moeflow_kv_handoffs_given_up_total{outcome="recomputes"}'] >= dm.get(
            'moeflow_kv_handoffs_given_up_total{outcome="failures"}', 0)
        wait_clean(split.prefill, split.decode)
    finally:
        split.stop()


def test_refusal_disconnect_and_lease(path, tmp_path):
    """A decode server with room for one request's whole life (reserve admission) and a one-deep
    pre-allocation queue: concurrent requests are refused (503 from the router, the prefill server's
    ranges released at once, long before its 300 s lease), a client that leaves mid-stream frees its
    request on the decode server, and nothing stays held."""
    split = Split(path, tmp_path, prefill=["--kv-lease-s", "300"],
                  decode=["--num-kv-blocks", "8", "--kv-admission", "reserve", "--max-pending-handoffs", "1",
                          "--max-num-seqs", "1"])
    try:
        answers = split.load(PROMPTS[:12], max_tokens=60, workers=12)
        codes = sorted(r.status_code for r in answers)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.json()["error"]["code"] == "no_decode_server" and refused.headers["retry-after"] == "1"
        wait_clean(split.prefill, split.decode)  # within 10 s: the 300 s lease did not free them
        with httpx.stream("POST", split.router.url + "/v1/completions", timeout=60,
                          json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    break  # leaves with the request decoding
        wait_clean(split.prefill, split.decode)
    finally:
        split.stop()


@pytest.mark.slow  # the lease's path is test_pd_lifecycle's too, in process
def test_lease_runs_out_while_the_decode_server_is_full(path, tmp_path):
    """The prefill server's 0.3 s lease ends while handoffs wait for decode room: their claims find
    nothing, and the decode server recomputes them; all answers are the reference's."""
    split = Split(path, tmp_path, prefill=["--kv-lease-s", "0.3"],
                  decode=["--num-kv-blocks", "8", "--kv-admission", "reserve", "--max-num-seqs", "1"])
    try:
        prompts = PROMPTS[:4]
        answers = split.load(prompts, max_tokens=60, workers=4)
        assert [r.status_code for r in answers] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in answers] == expected(path, prompts, 60)
        assert split.prefill.metrics()['moeflow_kv_handoffs_given_up_total{outcome="lease_expiries"}'] >= 1
        assert split.decode.metrics()['moeflow_kv_handoffs_given_up_total{outcome="recomputes"}'] >= 1
        wait_clean(split.prefill, split.decode)
    finally:
        split.stop()


def test_a_decode_server_that_dies(path, tmp_path):
    """SIGKILL the decode server while requests decode: each one ends within 5 s with an error (the
    relayed stream breaks), the router then answers 503 at once, and the prefill server frees
    every range (the dead server's pair ended)."""
    split = Split(path, tmp_path)
    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(split.complete, ids, 400) for ids in PROMPTS[:6]]
            time.sleep(1.0)
            t0 = time.monotonic()
            os.kill(split.decode.proc.pid, signal.SIGKILL)
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(f.result().status_code)
                except httpx.HTTPError as e:
                    outcomes.append(type(e).__name__)
            ended_s = time.monotonic() - t0
        assert ended_s < 5 and all(o != 200 for o in outcomes), (ended_s, outcomes)
        time.sleep(0.5)  # the router's poller marks it down
        t1 = time.monotonic()
        r = split.complete(PROMPTS[0])
        assert r.status_code == 503 and time.monotonic() - t1 < 5
        deadline = time.monotonic() + 10
        while (info := httpx.get(split.prefill.url + "/v1/kv_transfer").json())["num_handoffs"]:
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        assert info["num_free_kv_blocks"] == info["num_kv_blocks"]
    finally:
        split.stop()
