"""A prefill server on one "host" and a decode server on another (network namespaces joined by a
veth pair), behind ``moeflow router``: the decode server pulls each request's KV over the link's
gloo pair (it cannot map the other host's shared memory), and the answers equal colocated's.

Needs root and ``ip`` (skipped otherwise, saying why); the namespaces are removed afterwards.
"""
from __future__ import annotations

import openai

from moeflow import LLM, SamplingParams

from netns import two_hosts
from server_harness import ServerProcess
from test_pd_router import COMMON, PROMPTS, wait_clean


def test_prefill_and_decode_on_two_hosts(checkpoints, tmp_path):
    path = checkpoints("deepseek_v3").path  # MLA: the latent rows travel
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(path, dtype="float32") as ref:
        expected = [o.outputs[0].text for o in ref.generate(PROMPTS, sp)]
    with two_hosts("pd", a_is_here=True) as (a, b):
        servers = []
        try:
            servers.append(ServerProcess(path, "--role", "prefill", "--kv-host", a.addr, *COMMON,
                                         log_path=str(tmp_path / "prefill.log"), host=a))
            servers.append(ServerProcess(path, "--role", "decode", "--mode", "dep", "--dp", "2", *COMMON,
                                         log_path=str(tmp_path / "decode.log"), host=b, start_timeout_s=90))
            router = ServerProcess(None, "--prefill", servers[0].url, "--decode", servers[1].url,
                                   log_path=str(tmp_path / "router.log"))
            servers.append(router)
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
            got = [client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for ids in PROMPTS]
            assert got == expected
            dm = servers[1].metrics()
            assert dm['moeflow_kv_transfer_seconds_count{path="gloo"}'] == len(PROMPTS)
            assert 'moeflow_kv_transfer_seconds_count{path="shm"}' not in dm
            wait_clean(servers[0], servers[1])
        finally:
            for s in reversed(servers):
                s.stop()
