"""OpenAIServing: /v1/completions and /v1/chat/completions on top of the AsyncEngine.

One request body: check it -> token ids -> SamplingParams (the engine's validation) -> its n
engine requests (``LLM.make_requests``), submitted (429/503 at once when refused) -> wait for the
engine thread to queue them (a RequestError is a 400) -> a JSON answer, or an SSE stream
(``answer.py``). Either way a client that goes away aborts what is unfinished, which frees its KV
blocks; so does a choice that fails, for the others.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from moeflow.core import RequestError
from moeflow.kv_handle import KvHandle
from moeflow.server import errors
from moeflow.server.answer import Answer, sse
from moeflow.server.async_engine import AsyncEngine
from moeflow.server.chat import render_chat
from moeflow.server.config import ServerConfig
from moeflow.server.errors import ApiError
from moeflow.server.health import EngineUnavailable, Overloaded
from moeflow.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from moeflow.server.stream import RequestStream, merged

_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Handoff:
    """A request's part in a prefill/decode split across servers (from ``kv_transfer_params``)."""

    remote_decode: bool = False  # a prefill server's: stage the KV for a decode server, answer with its handle
    source: KvHandle | None = None  # a decode server's: the prefill server's handle to the prompt's KV


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
        kv = self._kv_transfer(body)
        self._check(body)
        tokenizer = self.engine.llm.tokenizer
        ids = await self._encode(lambda: body.prompt_ids(tokenizer), "prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else _DEFAULT_COMPLETION_MAX_TOKENS
        return await self._run("text_completion", f"cmpl-{body.request_id or uuid.uuid4().hex}", ids, "prompt",
                               max_tokens, body, raw, kv)

    async def chat(self, body: ChatCompletionRequest, raw: HttpRequest):
        kv = self._kv_transfer(body)
        self._check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tokenizer = self.engine.llm.tokenizer

        def render() -> list[int]:
            return body.truncated(render_chat(
                tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, add_special_tokens=body.add_special_tokens,
                template_kwargs=body.chat_template_kwargs).token_ids)

        ids = await self._encode(render, "messages")
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # the rest of the context (at least 1, so an overlong prompt is named as such)
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        return await self._run("chat.completion", f"chatcmpl-{body.request_id or uuid.uuid4().hex}", ids,
                               "messages", max_tokens, body, raw, kv)

    # -- shared steps -------------------------------------------------------------------------

    def _check(self, body: _Sampling) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.model_name!r}", param="model", code="model_not_found")
        body.check_supported()

    def _kv_transfer(self, body: _Sampling) -> Handoff:
        """What ``kv_transfer_params`` asks of this server's role, taken off the body (it is no sampling
        field); on a server without a role it stays, and ``_check`` refuses it."""
        p, role = body.kv_transfer_params, self.config.role
        if p is None or role is None:
            return Handoff()
        body.kv_transfer_params = None
        if body.n != 1:
            raise errors.bad_request(f"n={body.n}: a prefill/decode handoff carries one sample", param="n")
        if role == "prefill":
            if p.get("do_remote_decode") is not True:
                raise errors.bad_request("kv_transfer_params: a prefill server takes {\"do_remote_decode\": true}",
                                         param="kv_transfer_params")
            if body.stream:
                raise errors.bad_request("a prefill server answers a remote decode's prefill as one JSON body "
                                         "(stream=false)", param="stream")
            return Handoff(remote_decode=True)
        if p.get("do_remote_prefill") is not True:
            raise errors.bad_request("kv_transfer_params: a decode server takes the prefill server's answer's "
                                     "kv_transfer_params (do_remote_prefill: true, ...)", param="kv_transfer_params")
        try:
            return Handoff(source=KvHandle.from_params(p))
        except ValueError as e:
            raise errors.bad_request(str(e), param="kv_transfer_params") from None

    @staticmethod
    async def _encode(fn, param: str) -> list[int]:
        """Tokenize on a worker thread: a 4 MB prompt tokenized on the event loop held /health (and
        every stream) for 0.7-0.9 s here; a fast tokenizer releases the GIL, a Python one yields it."""
        try:
            return await asyncio.to_thread(fn)
        except (ValueError, TypeError) as e:  # a lone surrogate, a template that refuses the roles, ...
            raise errors.bad_request(f"{param} cannot be tokenized: {e}", param=param) from e

    async def _run(self, kind: str, rid: str, ids: list[int], prompt_param: str, max_tokens: int,
                   body: _Sampling, raw: HttpRequest, kv: Handoff):
        def invalid(e: RequestError) -> ApiError:
            err = errors.from_request_error(e, prompt_param, len(ids), self.engine.max_model_len)
            if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                err.param = "max_completion_tokens"  # name the field the client sent
            return err

        try:
            params = body.sampling_params(max_tokens)
            # off the loop: it checks and copies every id (4 M of them held the loop for 0.7 s)
            requests = await asyncio.to_thread(self.engine.llm.make_requests, {"prompt_token_ids": ids}, params, rid)
        except RequestError as e:
            self._release(kv)
            raise invalid(e) from e
        for r in requests:
            r.kv_handoff, r.kv_source = kv.remote_decode, kv.source
        streams: list[RequestStream] = []
        try:
            for r in requests:
                streams.append(self.engine.submit(r))
            for s in streams:
                await s.accepted()
        except BaseException as e:  # refused, or cancelled while queued: nobody will read the answer
            self._abort(streams)
            self._release(kv)
            if isinstance(e, Overloaded):
                raise errors.overloaded(self.engine.max_pending) from None
            if isinstance(e, EngineUnavailable):
                raise errors.unavailable(str(e), e.retry_after_s) from None
            if isinstance(e, RequestError):
                raise invalid(e) from e
            raise
        head = dict(id=rid, created=int(time.time()), model=self.config.model_name)
        answer = Answer(kind, head, self.engine.llm.tokenizer, body, streams[0].request.num_prompt_tokens)
        if body.stream:
            return StreamingResponse(self._stream(answer, streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._answer(answer, streams, raw)

    def _release(self, kv: Handoff) -> None:
        """A refused handoff: its prefill server need not keep the KV until the lease runs out."""
        if kv.source is not None:
            self.engine.release_kv(kv.source)

    def _abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request.request_id)

    async def _answer(self, answer: Answer, streams: list[RequestStream], raw: HttpRequest) -> JSONResponse:
        """The whole answer as one JSON body; aborts what is unfinished if the client leaves first."""

        async def collect():
            async for i, d in merged(streams):
                if d.finish_reason is not None and d.finish_reason not in ("stop", "length"):
                    return d
                answer.add(i, d)
            return None

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            self._abort(streams)
        if not work.done() or work.cancelled():
            return JSONResponse({}, status_code=499)  # nobody reads it: the client is gone
        failed = work.result()
        if failed is not None:
            raise self._failure(failed)
        return JSONResponse(answer.body())

    async def _stream(self, answer: Answer, streams: list[RequestStream]):
        try:
            for c in answer.opening():
                yield c
            async for i, d in merged(streams):
                if d.finish_reason is not None and d.finish_reason not in ("stop", "length"):
                    yield sse(self._failure(d).body())  # the status line is sent already: an error event
                    break
                if (c := answer.chunk(i, d)) is not None:
                    yield c
            else:
                for c in answer.closing():
                    yield c
            yield "data: [DONE]\n\n"
        finally:
            self._abort(streams)  # the client went away mid-stream, or a choice failed

    @staticmethod
    def _failure(d) -> ApiError:
        if d.finish_reason == "abort":
            return errors.unavailable(d.error or "the request was aborted")
        return errors.engine_failed(d.error or "unknown engine error")
