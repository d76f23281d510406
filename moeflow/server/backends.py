"""The router's prefill and decode servers: checked at start, watched while serving, chosen per request.

At start every server must answer ``GET /v1/kv_transfer`` in its role (a ``--prefill`` URL that is
a decode server, or has no role, is refused by name) and every one must run the same KV layout
(model, layers, dtype) and the same weights (their fingerprints): a mismatch is refused at start,
naming both servers, instead of surfacing as failed handoffs or, worse, as other outputs later. While serving, a poller reads each server's load a few times a second.
A request goes to the prefill server with the fewest of this router's requests in flight, then to
the decode server with the most free KV blocks (its last report, less the blocks of the requests
placed on it since), as SGLang's and vLLM's routers place them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from moeflow.config import ConfigError
from moeflow.kv_handle import KvLayout

logger = logging.getLogger("moeflow.router")

POLL_S = 0.25  # how often the decode servers' free KV is read


@dataclass
class Backend:
    url: str
    role: str
    in_flight: int = 0  # this router's requests on it now
    healthy: bool = True
    num_free_kv_blocks: int = 0  # at the last poll
    placed_blocks: int = 0  # blocks of the requests placed on it since the last poll (an estimate)
    block_tokens: int = 16


class Backends:
    def __init__(self, prefill: list[str], decode: list[str], client: httpx.AsyncClient):
        if not prefill or not decode:
            raise ConfigError("moeflow router needs at least one --prefill and one --decode server")
        self.client = client
        self.prefill = [Backend(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Backend(u.rstrip("/"), "decode") for u in decode]
        self.model_name: str | None = None
        self.max_model_len: int | None = None
        self._poller: asyncio.Task | None = None

    async def check(self, wait_s: float) -> None:
        """Every server up (waiting up to ``wait_s`` for those still loading), in its role, one KV layout."""
        deadline = time.monotonic() + wait_s
        layouts: dict[str, KvLayout] = {}
        weights: dict[str, str] = {}
        for b in self.prefill + self.decode:
            info = await self._info(b, deadline)
            if info["role"] != b.role:
                raise ConfigError(f"{b.url} is a {info['role']} server, given as --{b.role}")
            layouts[b.url] = KvLayout.from_dict(info["kv_layout"], f"{b.url}'s kv_layout")
            weights[b.url] = str(info.get("weights"))
            b.num_free_kv_blocks = info["num_free_kv_blocks"]
            models = (await self.client.get(f"{b.url}/v1/models")).json()["data"][0]
            if self.model_name is None:
                self.model_name, self.max_model_len = models["id"], models.get("max_model_len")
            elif models["id"] != self.model_name:
                raise ConfigError(f"{b.url} serves {models['id']!r} but {self.prefill[0].url} serves "
                                  f"{self.model_name!r}: give every server the same --served-model-name")
        first_url = self.prefill[0].url
        for url, lay in layouts.items():
            if lay != layouts[first_url]:
                raise ConfigError(f"{url} runs {lay.describe()} but {first_url} runs {layouts[first_url].describe()}: "
                                  f"a KV cache passes only between the same model and dtype")
            if weights[url] != weights[first_url]:
                raise ConfigError(f"{url} holds weights {weights[url]} but {first_url} holds {weights[first_url]} "
                                  f"(fingerprints of their checkpoints): a KV cache passes only between the same "
                                  f"weights; give every server the same checkpoint")

    async def _info(self, b: Backend, deadline: float) -> dict:
        last = None
        while time.monotonic() < deadline:
            try:
                r = await self.client.get(f"{b.url}/v1/kv_transfer")
            except httpx.HTTPError as e:  # not listening yet
                last = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.2)
                continue
            if r.status_code == 404:
                raise ConfigError(f"{b.url} has no prefill/decode role: start it with moeflow serve --role {b.role}")
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            await asyncio.sleep(0.2)
        raise ConfigError(f"{b.url} ({b.role}) did not answer GET /v1/kv_transfer in time (last: {last})")

    # -- while serving ------------------------------------------------------------------------

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._refresh(b) for b in self.prefill + self.decode))
            await asyncio.sleep(POLL_S)

    async def _refresh(self, b: Backend) -> None:
        try:
            r = await self.client.get(f"{b.url}/v1/kv_transfer", timeout=2.0)
            info = r.json()
            healthy = r.status_code == 200 and info.get("healthy", False)
        except (httpx.HTTPError, ValueError):
            healthy, info = False, {}
        if healthy != b.healthy:
            logger.warning("%s server %s is %s", b.role, b.url, "back" if healthy else "unreachable or unhealthy")
        b.healthy = healthy
        if healthy:
            b.num_free_kv_blocks, b.placed_blocks = info["num_free_kv_blocks"], 0

    def pick_prefill(self) -> Backend | None:
        live = [b for b in self.prefill if b.healthy] or self.prefill  # none looks live: try anyway
        return min(live, key=lambda b: b.in_flight)

    def decode_order(self, prompt_tokens: int) -> list[Backend]:
        """Decode servers, most free KV first; the first one is charged the request's blocks."""
        live = [b for b in self.decode if b.healthy] or self.decode
        order = sorted(live, key=lambda b: (b.placed_blocks - b.num_free_kv_blocks, b.in_flight))
        order[0].placed_blocks += -(-prompt_tokens // order[0].block_tokens)
        return order

    @property
    def healthy(self) -> tuple[bool, str]:
        for side in (self.prefill, self.decode):
            if not any(b.healthy for b in side):
                return False, f"no {side[0].role} server is healthy ({', '.join(b.url for b in side)})"
        return True, "ok"
