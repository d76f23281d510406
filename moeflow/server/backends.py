"""The router's prefill and decode servers: checked at start, watched while serving, chosen per request.

At start every server must answer ``GET /v1/kv_transfer`` in its role (a ``--prefill`` URL that is
a decode server, or has no role, is refused by name) and every one must run the same KV layout
(model, layers, dtype) and the same weights (their fingerprints): a mismatch is refused at start,
naming both servers, instead of surfacing as failed handoffs or, worse, as other outputs later. While serving, a poller reads each server's load a few times a second.
A request goes to the prefill server with the fewest of this router's requests in flight, then to
the decode server with the most free KV blocks (its last report, less the blocks of the requests
placed on it since), as SGLang's and vLLM's routers place them.

While serving, servers are registered (checked as at start) and deregistered (``router_admin.py``):
a deregistered server takes no new request and leaves once none of this router's requests needs it,
a prefill server only after every request it prefilled has had its KV read by a decode server.
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
    # deregistered: takes no new request, and leaves once none of this router's requests needs it
    draining: bool = False
    # requests this prefill server prefilled whose decode server has not yet answered: their KV is
    # still read from it
    handing_off: int = 0

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.handing_off > 0

    def to_dict(self) -> dict:
        return {"url": self.url, "worker_type": self.role, "healthy": self.healthy,
                "state": "draining" if self.draining else "serving", "in_flight": self.in_flight,
                "handing_off": self.handing_off}


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
        self._layout: KvLayout | None = None  # what every server runs (the first one checked)
        self._weights: tuple[str, str] | None = None  # (its fingerprint, the server it was read from)
        self.events = {"added": 0, "removed": 0, "drained": 0}  # membership changes while serving

    async def check(self, wait_s: float) -> None:
        """Every server up (waiting up to ``wait_s`` for those still loading), in its role, one KV layout."""
        deadline = time.monotonic() + wait_s
        for b in self.prefill + self.decode:
            await self._admit(b, deadline)

    async def _admit(self, b: Backend, deadline: float) -> None:
        """``b`` answers in its role with the model, KV layout and weights of the servers already in."""
        info = await self._info(b, deadline)
        if info["role"] != b.role:
            raise ConfigError(f"{b.url} is a {info['role']} server, given as --{b.role}")
        layout = KvLayout.from_dict(info["kv_layout"], f"{b.url}'s kv_layout")
        weights = str(info.get("weights"))
        models = (await self.client.get(f"{b.url}/v1/models")).json()["data"][0]
        if self.model_name is not None and models["id"] != self.model_name:
            raise ConfigError(f"{b.url} serves {models['id']!r} but {self._weights[1]} serves "
                              f"{self.model_name!r}: give every server the same --served-model-name")
        if self._layout is not None and layout != self._layout:
            raise ConfigError(f"{b.url} runs {layout.describe()} but {self._weights[1]} runs {self._layout.describe()}: "
                              f"a KV cache passes only between the same model and dtype")
        if self._weights is not None and weights != self._weights[0]:
            raise ConfigError(f"{b.url} holds weights {weights} but {self._weights[1]} holds {self._weights[0]} "
                              f"(fingerprints of their checkpoints): a KV cache passes only between the same "
                              f"weights; give every server the same checkpoint")
        if self.model_name is None:
            self.model_name, self.max_model_len = models["id"], models.get("max_model_len")
            self._layout, self._weights = layout, (weights, b.url)
        b.num_free_kv_blocks = info["num_free_kv_blocks"]

    # -- membership while serving -------------------------------------------------------------

    def find(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.prefill + self.decode if b.url == url), None)

    async def add(self, url: str, role: str, wait_s: float) -> Backend:
        """Register a server while serving: checked as the ones given at start were, then chosen
        like them from the next request on."""
        if role not in ("prefill", "decode"):
            raise ConfigError(f"worker_type must be 'prefill' or 'decode', got {role!r}")
        if self.find(url) is not None:
            raise ConfigError(f"{url.rstrip('/')} is already registered ({self.find(url).role}"
                              f"{', draining' if self.find(url).draining else ''})")
        b = Backend(url.rstrip("/"), role)
        await self._admit(b, time.monotonic() + wait_s)
        if self.find(url) is not None:  # registered by another call meanwhile
            raise ConfigError(f"{b.url} is already registered")
        (self.prefill if role == "prefill" else self.decode).append(b)
        self.events["added"] += 1
        logger.info("%s server %s registered", role, b.url)
        return b

    def remove(self, url: str) -> Backend:
        """Deregister a server: it takes no new request at once and leaves this router once none of
        its requests needs it (``drained``). The last serving server of a role is refused."""
        b = self.find(url)
        if b is None:
            raise KeyError(f"{url.rstrip('/')} is not registered")
        if not b.draining:
            side = self.prefill if b.role == "prefill" else self.decode
            if not [x for x in side if not x.draining and x is not b]:
                raise ConfigError(f"{b.url} is the last {b.role} server: register another before removing it")
            b.draining = True
            self.events["removed"] += 1
            logger.info("%s server %s deregistered: draining %d requests", b.role, b.url, b.in_flight + b.handing_off)
        self.settle()
        return b

    def settle(self) -> None:
        """Drop the draining servers that no request needs any more."""
        for side in (self.prefill, self.decode):
            for b in [x for x in side if x.draining and not x.busy]:
                side.remove(b)
                self.events["drained"] += 1
                logger.info("%s server %s drained and left", b.role, b.url)

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
            self.settle()
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
        serving = [b for b in self.prefill if not b.draining]
        live = [b for b in serving if b.healthy] or serving  # none looks live: try anyway
        return min(live, key=lambda b: b.in_flight)

    def decode_order(self, prompt_tokens: int) -> list[Backend]:
        """Decode servers, most free KV first; the first one is charged the request's blocks."""
        serving = [b for b in self.decode if not b.draining]
        live = [b for b in serving if b.healthy] or serving
        order = sorted(live, key=lambda b: (b.placed_blocks - b.num_free_kv_blocks, b.in_flight))
        order[0].placed_blocks += -(-prompt_tokens // order[0].block_tokens)
        return order

    @property
    def healthy(self) -> tuple[bool, str]:
        for role, side in (("prefill", self.prefill), ("decode", self.decode)):
            serving = [b for b in side if not b.draining]
            if not any(b.healthy for b in serving):
                return False, f"no {role} server is healthy ({', '.join(b.url for b in serving)})"
        return True, "ok"
