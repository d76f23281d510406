"""KV blocks on demand through the server: long streams and chats without max_tokens (the OpenAI
SDK's default, "the rest of the context") no longer reserve their whole lives, so a short request
sent meanwhile is answered while they run. Under whole-life reservation (``--kv-admission
reserve``, the old policy) a 64-block cache held two of them and the short one waited for one to
end. /metrics reports the cache's use and the preemptions; /expert_distribution the routed load."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from moeflow.layout.expert_map import ExpertMap
from moeflow.scheduler.expert_location import initial_map
from server_harness import ServerProcess


async def _stream_until_done(c: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event) -> float:
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                started.set()
    return time.monotonic()


async def _short_while_long_run(url: str, path: str, long_body: dict, n_long: int, short_body: dict):
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        events = [asyncio.Event() for _ in range(n_long)]
        longs = [asyncio.ensure_future(_stream_until_done(c, path, long_body, e)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)  # every long one is running
        t0 = time.monotonic()
        r = await c.post(path, json=short_body)
        short_done = time.monotonic()
        ends = await asyncio.gather(*longs)
        return r, short_done - t0, short_done, ends


def test_a_short_request_is_answered_while_long_ones_run(checkpoints, tmp_path):
    s = ServerProcess(checkpoints("qwen3").path, "--mode", "asap", "--attn-dp", "1", "--moe-workers", "1",
                      "--dtype", "float32", "--num-kv-blocks", "64", log_path=str(tmp_path / "server.log"))
    try:
        # two streams that would each reserve 32 of the 64 blocks (16 tokens each) for their whole lives
        long = {"prompt": [1, 2, 3, 4], "max_tokens": 508, "ignore_eos": True, "temperature": 0}
        short = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        r, took_s, done, ends = asyncio.run(_short_while_long_run(s.url, "/v1/completions", long, 2, short))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert done < min(ends), "the short request waited for a long one to end"
        print(f"two long streams: the short request took {took_s:.2f} s")
        # six chats without max_tokens: each may run to the end of the context (~500 tokens)
        chat = {"messages": [{"role": "user", "content": "tell a long story"}], "temperature": 0}
        short_chat = {**chat, "max_tokens": 4}
        r, took_s, done, ends = asyncio.run(_short_while_long_run(s.url, "/v1/chat/completions", chat, 6, short_chat))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert done < min(ends), "the short chat waited for a long one to end"
        print(f"six chats without max_tokens: the short one took {took_s:.2f} s")
        m = s.metrics()
        assert 0 <= m["moeflow_kv_cache_usage_ratio"] <= 1 and m["moeflow_kv_blocks_free"] == 64
        key = 'moeflow_preemptions_total{group="0"}'
        assert key in m  # six ~500-token lives in 1024 slots: some preempted
        print(f"preemptions: {m[key]:.0f}")
        # what the MoE worker computed, as a file the next deployment can start from
        d = httpx.get(s.url + "/expert_distribution").json()
        rows = d["logical_count"]
        assert d["num_experts"] == len(rows[0]) and len(rows) == len(d["moe_layers"]) and d["work_items"] > 0
        assert len({sum(r) for r in rows}) == 1 and sum(rows[0]) > 0  # every layer routed every token, K each
        held = ExpertMap.contiguous(d["num_experts"], 2, 1, num_redundant=2).layers[0]
        assert initial_map(_saved(tmp_path, d), held, d["num_experts"], d["moe_layers"]).num_slots == len(rows[0]) + 2
    finally:
        assert s.stop() in (0, 143), s.log()


def _saved(tmp_path, data) -> str:
    p = tmp_path / "expert_distribution.json"
    p.write_text(json.dumps(data))
    return str(p)
