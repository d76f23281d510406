"""Load generator for ``bench serve --base-url``: a workload sent to an OpenAI-compatible server.

Each request is a streamed ``POST /v1/completions`` (``stream: true``, ``stream_options:
{include_usage: true}``) with the prompt as token ids, sent at its workload arrival time
(``WorkloadRequest.arrival_s`` after the start; all at once when the rate is infinite) and, with
``max_concurrency``, only once fewer than that many are in flight (an asyncio semaphore, as vLLM:
the wait counts in no latency since the clock starts at the send). The client records what
``http_metrics`` needs: time to the first chunk, every later chunk's gap, the last chunk, and the
output token count from the final usage chunk. No torch: this runs against any server.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from moeflow.bench.http_metrics import RequestOutcome
from moeflow.measure.workload import WorkloadRequest


@dataclass(frozen=True)
class HttpClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: leave "model" out; the server answers with its served model
    max_concurrency: int | None = None  # most requests in flight; None: no limit
    api_key: str | None = None
    timeout_s: float = 600.0  # per request, the whole stream
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"--endpoint must start with '/', got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be > 0, got {self.timeout_s}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass(frozen=True)
class HttpRun:
    outcomes: list[RequestOutcome]  # in workload order
    duration_s: float  # from the first scheduled send to the last request's end


def token_prompts(requests: list[WorkloadRequest], seed: int) -> list[list[int]]:
    """Random token ids in [0, 256): bytes, valid for any vocabulary of at least 256 (``tiny``'s is
    byte-level); the same ids ``bench.replay.random_prompts`` gives the in-process benchmark."""
    rng = np.random.default_rng([seed, 1])
    return [rng.integers(0, 256, r.prompt_len).tolist() for r in requests]


def run_requests(cfg: HttpClientConfig, requests: list[WorkloadRequest], prompts: list[list[int]]) -> HttpRun:
    """Send every request on its schedule and wait for all of them (blocks)."""
    return asyncio.run(_run(cfg, requests, prompts))


async def _run(cfg: HttpClientConfig, requests: list[WorkloadRequest], prompts: list[list[int]]) -> HttpRun:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = _bar(len(requests), cfg.progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def one(req: WorkloadRequest, prompt: list[int]) -> RequestOutcome:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            if sem is None:
                out = await _send(client, cfg, req, prompt)
            else:
                async with sem:
                    out = await _send(client, cfg, req, prompt)
            if bar is not None:
                bar.update(1)
            return out

        outcomes = await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return HttpRun(list(outcomes), duration)


async def _send(client, cfg: HttpClientConfig, req: WorkloadRequest, prompt: list[int]) -> RequestOutcome:
    # NOTE: ignore_eos so every request generates exactly max_tokens, as the in-process replay does.
    body = {"prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.model is not None:
        body["model"] = cfg.model
    sent = time.perf_counter()
    ttft: float | None = None
    last = sent
    gaps: list[float] = []
    num_out, num_in = 0, req.prompt_len
    try:
        async with client.stream("POST", cfg.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestOutcome(req.prompt_len, False, error=f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    return RequestOutcome(req.prompt_len, False, error=str(data["error"])[:300])
                now = time.perf_counter()
                if data.get("choices"):
                    if ttft is None:  # vLLM's rule: the first chunk with choices is the first token
                        ttft = now - sent
                    else:
                        gaps.append(now - last)
                    last = now
                elif data.get("usage"):
                    num_out = data["usage"].get("completion_tokens", 0)
                    num_in = data["usage"].get("prompt_tokens", num_in)
    except Exception as e:  # a network error or a malformed stream fails this request, not the run
        return RequestOutcome(req.prompt_len, False, error=f"{type(e).__name__}: {e}")
    if ttft is None:
        return RequestOutcome(num_in, False, error="the stream ended without a token")
    return RequestOutcome(num_in, True, ttft, last - sent, tuple(gaps), num_out)


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
