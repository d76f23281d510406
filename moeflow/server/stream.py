"""RequestStream: one request's channel from the engine thread to its HTTP handler.

The engine thread calls ``accept`` once (with the refusal, if any), then ``push``es deltas, the
last one carrying a finish_reason; both go through ``loop.call_soon_threadsafe``, the only safe
way into an asyncio loop from another thread. The handler awaits ``accepted()`` and iterates.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from moeflow.core import Request


@dataclass(frozen=True)
class Delta:
    """Engine thread -> one request's handler: what one step produced for it."""

    token_ids: tuple[int, ...]  # new output tokens, in order
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"; set on the last delta only
    error: str | None = None  # why it ended, with finish_reason "error" (or "abort" at shutdown)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if not fut.done():  # a handler that went away cancelled it
        fut.set_result(None) if error is None else fut.set_exception(error)


class RequestStream:
    """The handler's end of one request: first acceptance (or refusal), then its deltas."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.finished = False  # the final delta was read
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._accepted = loop.create_future()

    # -- engine thread --
    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    def accept(self, error: BaseException | None = None) -> None:
        self._call(_resolve, self._accepted, error)

    def push(self, delta: Delta) -> None:
        self._call(self._queue.put_nowait, delta)

    # -- handler (event loop) --
    async def accepted(self) -> None:
        """Returns once the engine queued the request; raises its refusal (RequestError, EngineUnavailable)."""
        await self._accepted

    async def __aiter__(self):
        while not self.finished:
            d = await self._queue.get()
            self.finished = d.finish_reason is not None
            yield d


@dataclass
class Tracked:
    """What the server adds to a request the engine's pool owns: its client stream and when its
    last token was delivered (for inter-token latency); the request itself is the stream's."""

    stream: RequestStream
    last_token_s: float | None = None  # None until the first token
