"""OpenAIServing: /v1/completions and /v1/chat/completions on top of the AsyncEngine.

One request: check the body -> token ids -> SamplingParams (the engine's validation) -> submit
(429/503 at once when refused) -> wait for the engine thread to queue it (its RequestError is a
400) -> a JSON answer, or an SSE stream. Either way a client that goes away aborts its request,
which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from moeflow.core import RequestError, SamplingParams
from moeflow.engine.detokenizer import IncrementalDetokenizer
from moeflow.server import errors
from moeflow.server.async_engine import AsyncEngine
from moeflow.server.health import EngineUnavailable, Overloaded
from moeflow.server.stream import RequestStream
from moeflow.server.chat import render_chat
from moeflow.server.config import ServerConfig
from moeflow.server.errors import ApiError
from moeflow.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(raw: HttpRequest) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config

    # -- the two endpoints --------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, raw: HttpRequest):
        self._check(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = await self._encode(lambda: list(self.engine.llm.tokenizer.encode(prompt)), "prompt")
        else:
            ids = prompt
        max_tokens = body.max_tokens if body.max_tokens is not None else _DEFAULT_COMPLETION_MAX_TOKENS
        return await self._run("text_completion", f"cmpl-{uuid.uuid4().hex}", ids, "prompt", max_tokens, body, raw)

    async def chat(self, body: ChatCompletionRequest, raw: HttpRequest):
        self._check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await self._encode(lambda: render_chat(self.engine.llm.tokenizer, messages).token_ids, "messages")
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # the rest of the context (at least 1, so an overlong prompt is named as such)
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        return await self._run("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", ids, "messages", max_tokens,
                               body, raw)

    # -- shared steps -------------------------------------------------------------------------

    def _check(self, body: _Sampling) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.model_name!r}", param="model", code="model_not_found")
        body.check_supported()

    @staticmethod
    async def _encode(fn, param: str) -> list[int]:
        """Tokenize on a worker thread: a 4 MB prompt tokenized on the event loop held /health (and
        every stream) for 0.7-0.9 s here; a fast tokenizer releases the GIL, a Python one yields it."""
        try:
            return await asyncio.to_thread(fn)
        except (ValueError, TypeError) as e:  # a lone surrogate, a template that refuses the roles, ...
            raise errors.bad_request(f"{param} cannot be tokenized: {e}", param=param) from e

    def _params(self, body: _Sampling, max_tokens: int) -> SamplingParams:
        kw = dict(max_tokens=max_tokens, ignore_eos=body.ignore_eos, seed=body.seed,
                  stop_token_ids=tuple(body.stop_token_ids or ()))
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                kw[name] = getattr(body, name)
        return SamplingParams(**kw)

    async def _run(self, kind: str, rid: str, ids: list[int], prompt_param: str, max_tokens: int,
                   body: _Sampling, raw: HttpRequest):
        def invalid(e: RequestError) -> ApiError:
            err = errors.from_request_error(e, prompt_param, len(ids), self.engine.max_model_len)
            if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                err.param = "max_completion_tokens"  # name the field the client sent
            return err

        try:
            params = self._params(body, max_tokens)
            # off the loop: it checks and copies every id (4 M of them held the loop for 0.7 s)
            request = await asyncio.to_thread(self.engine.llm.make_request, {"prompt_token_ids": ids}, params, rid)
        except RequestError as e:
            raise invalid(e) from e
        try:
            stream = self.engine.submit(request)
        except Overloaded:
            raise errors.overloaded(self.engine.max_pending) from None
        except EngineUnavailable as e:
            raise errors.unavailable(str(e), e.retry_after_s) from None
        try:
            await stream.accepted()
        except RequestError as e:
            raise invalid(e) from e
        except EngineUnavailable as e:
            raise errors.unavailable(str(e), e.retry_after_s) from None
        except BaseException:  # cancelled while queued: nobody will read the answer
            self.engine.abort(rid)
            raise
        head = dict(id=rid, created=int(time.time()), model=self.config.model_name)
        if body.stream:
            return StreamingResponse(self._stream(kind, stream, head, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._answer(kind, stream, head, raw)

    async def _answer(self, kind: str, stream: RequestStream, head: dict, raw: HttpRequest) -> JSONResponse:
        """The whole completion as one JSON body; aborts the request if the client leaves first."""

        async def collect():
            ids, last = [], None
            async for d in stream:
                ids += d.token_ids
                last = d
            return ids, last

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.engine.abort(head["id"])
        if not work.done() or work.cancelled():
            return JSONResponse({}, status_code=499)  # nobody reads it: the client is gone
        ids, last = work.result()
        if last.finish_reason not in ("stop", "length"):
            raise self._failure(last)
        text = self.engine.llm.tokenizer.decode(ids, skip_special_tokens=True)
        if kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return JSONResponse({**head, "object": kind, "choices": [choice],
                             "usage": self._usage(stream, len(ids))})

    async def _stream(self, kind: str, stream: RequestStream, head: dict, include_usage: bool):
        chat = kind == "chat.completion"
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish_reason: str | None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if text is None else (
                    {"content": text} if text else {})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return _sse({**head, "choices": [c], **extra})

        text, num_tokens = IncrementalDetokenizer(self.engine.llm.tokenizer), 0
        try:
            if chat:
                yield chunk(None, None)
            async for d in stream:
                num_tokens += len(d.token_ids)
                if d.finish_reason is not None and d.finish_reason not in ("stop", "length"):
                    yield _sse(self._failure(d).body())  # the status line is sent already: an error event
                    break
                delta = text.add(list(d.token_ids), final=d.finish_reason is not None)
                # NOTE: a chunk per step that produced tokens, even when they decode to no text yet
                # (part of a UTF-8 character): clients time tokens by chunks (TTFT, ITL).
                if d.token_ids or d.finish_reason is not None:
                    yield chunk(delta, d.finish_reason)
            else:
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": self._usage(stream, num_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:  # the client went away mid-stream
                self.engine.abort(head["id"])

    @staticmethod
    def _usage(stream: RequestStream, num_tokens: int) -> dict:
        n = stream.request.num_prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": num_tokens, "total_tokens": n + num_tokens}

    @staticmethod
    def _failure(d) -> ApiError:
        if d.finish_reason == "abort":
            return errors.unavailable(d.error or "the request was aborted")
        return errors.engine_failed(d.error or "unknown engine error")
