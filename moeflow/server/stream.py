"""RequestStream: one request's channel from the engine thread to its HTTP handler.

The engine thread calls ``accept`` once (with the refusal, if any), then ``push``es deltas, the
last one carrying a finish_reason; both go through ``loop.call_soon_threadsafe``, the only safe
way into an asyncio loop from another thread. The handler awaits ``accepted()`` and iterates;
the n samples of one prompt (n > 1) are n streams that ``merged`` reads as one.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from moeflow.core import Request

# token id -> (logprob, rank): the sampled token plus the top n (moeflow.messages.RawLogprobs)
RawLogprobs = dict[int, tuple[float, int]]


@dataclass(frozen=True)
class Delta:
    """Engine thread -> one request's handler: what one step produced for it."""

    token_ids: tuple[int, ...]  # new output tokens, in order
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"; set on the last delta only
    error: str | None = None  # why it ended, with finish_reason "error" (or "abort" at shutdown)
    # the new output text, for a request with stop strings only (cut by the engine thread, which
    # alone touches ``Request.stop_strings``); None: the handler decodes ``token_ids`` itself
    text: str | None = None
    logprobs: tuple[RawLogprobs, ...] = ()  # one per token of token_ids, when params.logprobs is set
    prompt_logprobs: tuple[RawLogprobs, ...] = ()  # the next prompt positions' (from 1), when asked
    stop_reason: int | str | None = None  # on the last delta: the stop token id or stop string, if one ended it
    # on the last delta of a prefill server's handoff: the staged KV's handle (the answer's kv_transfer_params)
    kv_transfer_params: dict | None = None


def step_delta(request: Request, out, finished: bool) -> Delta | None:
    """Engine thread: the Delta of one step's output ``out`` (a ``messages.SeqOutput``, or None)
    for ``request``; None when the step told it nothing (a prefill chunk without prompt logprobs)."""
    p = request.params
    token = None if out is None else out.token_id
    tokens = () if token is None else (token,)
    # NOTE: read only when asked for: scripted engines' outputs carry nothing else
    logprobs = (out.logprobs,) if tokens and p.logprobs is not None else ()
    plp = tuple(out.prompt_logprobs) if out is not None and p.prompt_logprobs is not None else ()
    text = request.stop_strings.take() if request.stop_strings is not None else None
    if finished:
        kv = request.kv_handle.to_params() if request.kv_handle is not None else None
        return Delta(tokens, request.finish_reason, request.error, text, logprobs, plp, request.stop_reason, kv)
    if not tokens and not plp:
        return None
    return Delta(tokens, text=text, logprobs=logprobs, prompt_logprobs=plp)


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
        try:
            await self._accepted
        except asyncio.CancelledError:  # the engine may still queue it: the caller aborts it
            raise
        except BaseException:
            # refused: nothing of it runs, and an abort by its id could hit another request (a
            # client's request_id in use)
            self.finished = True
            raise

    async def __aiter__(self):
        while not self.finished:
            d = await self._queue.get()
            self.finished = d.finish_reason is not None
            yield d


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(index, delta) of every stream, in arrival order, until all have finished. Closing the
    generator early stops reading; the caller aborts what is unfinished."""
    if len(streams) == 1:  # the common case, without a task
        async for d in streams[0]:
            yield 0, d
        return
    inbox: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        async for d in s:
            inbox.put_nowait((i, d))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, d = await inbox.get()
            remaining -= d.finish_reason is not None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class Tracked:
    """What the server adds to a request the engine's pool owns: its client stream and when its
    last token was delivered (for inter-token latency); the request itself is the stream's."""

    stream: RequestStream
    last_token_s: float | None = None  # None until the first token

    def token_at(self, now: float) -> tuple[bool, float]:
        """A token reached the client at ``now``: (whether it is the first, seconds since the
        request arrived for the first, else since the token before)."""
        first = self.last_token_s is None
        gap = now - (self.stream.request.arrival_s if first else self.last_token_s)
        self.last_token_s = now
        return first, gap
