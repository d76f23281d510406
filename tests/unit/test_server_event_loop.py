"""The server's event loop stays free of per-token work: a long prompt is tokenized, and its ids
checked and copied into a request, on a worker thread. On the event loop a 4 MB text prompt held
/health (and every stream) for 0.5-0.8 s; JSON decoding itself still runs there (it holds the GIL
whichever thread runs it), bounded by --max-body-bytes."""
from __future__ import annotations

import asyncio
import threading

import httpx

from moeflow import LLM
from moeflow.engine.base import clock
from moeflow.server.app import build_app
from moeflow.server.async_engine import AsyncEngine
from moeflow.server.config import ServerConfig
from moeflow.server.metrics import ServerMetrics


class _Recording:
    """The model's tokenizer, noting the thread of every encode."""

    def __init__(self, inner, threads: list):
        self.inner, self.threads = inner, threads

    def encode(self, text):
        self.threads.append(("encode", threading.get_ident()))
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tokenizing_and_checking_a_prompt_run_off_the_event_loop(checkpoints):
    threads: list = []

    def make_llm():
        llm = LLM(checkpoints("qwen3").path, dtype="float32")
        llm.tokenizer = _Recording(llm.tokenizer, threads)
        make_requests = llm.make_requests

        def recording(*args, **kwargs):
            threads.append(("make_requests", threading.get_ident()))
            return make_requests(*args, **kwargs)

        llm.make_requests = recording
        return llm

    metrics = ServerMetrics(10.0, clock)
    engine = AsyncEngine(make_llm, 8, metrics)
    engine.start()
    app = build_app(engine, ServerConfig(model_name="m"), metrics)

    async def main():
        loop_thread = threading.get_ident()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 2})
        return loop_thread, r

    try:
        loop_thread, r = asyncio.run(main())
    finally:
        engine.shutdown()
    assert r.status_code == 200, r.text
    kinds = {k for k, _ in threads}
    assert kinds == {"encode", "make_requests"}, threads
    assert all(t != loop_thread for _, t in threads), threads
