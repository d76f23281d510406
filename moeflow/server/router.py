"""``moeflow router``: an OpenAI-compatible front over prefill and decode servers (vLLM's proxy, SGLang's
router in PD mode).

Per request: the body goes to a prefill server with ``max_tokens=1``, ``stream=false`` and
``kv_transfer_params: {do_remote_decode: true}``; its answer's ``kv_transfer_params`` (the staged
KV's handle and the first token) go to a decode server with the original body, and that server's
answer, streamed or whole, is the client's. So the first token reaches the client from the decode
server, after the handoff (SGLang's way): TTFT as the client measures it includes the transfer,
and each server's ``/metrics`` says what its side took. A decode server that refuses (429, 503) or
cannot be reached is skipped for the next; when none takes it, the prefill server is told to free
the KV at once. A client that leaves is passed on: the router closes its call to whichever server
has the request (which aborts it there and frees its KV), or releases the staged KV between the
two. A decode server that dies mid-stream ends the client's stream with an error event.
"""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeflow.server.backends import Backend, Backends
from moeflow.server.errors import ApiError
from moeflow.server.middleware import ApiKeyAuth
from moeflow.server.router_admin import add_admin_routes

logger = logging.getLogger("moeflow.router")

_RETRY = (429, 503)  # a decode server that answers these did not take the request: try the next
_GONE = object()  # what a call comes to when the client left first


def build_router(backends: Backends, timeout_s: float, api_key: str | None) -> FastAPI:
    app = FastAPI(title="moeflow router", version="0.1.0")
    client = backends.client
    # rejected: the prefill server refused the client's request (4xx); client_gone: it left first
    counts = {"ok": 0, "rejected": 0, "prefill_failed": 0, "no_decode": 0, "finished_on_prefill": 0,
              "client_gone": 0}

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.get("/health")
    async def health():
        ok, why = backends.healthy
        return {"status": "ok"} if ok else JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def metrics():
        lines = ["# TYPE moeflow_router_requests_total counter"]
        lines += [f'moeflow_router_requests_total{{outcome="{k}"}} {v}' for k, v in counts.items()]
        lines.append("# TYPE moeflow_router_in_flight gauge")
        lines += [f'moeflow_router_in_flight{{role="{b.role}",server="{b.url}"}} {b.in_flight}'
                  for b in backends.prefill + backends.decode]
        lines.append("# TYPE moeflow_router_servers gauge")
        lines += [f'moeflow_router_servers{{role="{role}",state="{state}"}} '
                  f'{sum(b.draining == (state == "draining") for b in side)}'
                  for role, side in (("prefill", backends.prefill), ("decode", backends.decode))
                  for state in ("serving", "draining")]
        lines.append("# TYPE moeflow_router_membership_events_total counter")
        lines += [f'moeflow_router_membership_events_total{{event="{k}"}} {v}' for k, v in backends.events.items()]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backends.model_name, "object": "model", "owned_by": "moeflow",
                                            "max_model_len": backends.max_model_len}]}

    async def route(path: str, raw: Request):
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request needs a JSON object body", code="invalid_type")
        if body.get("n", 1) != 1:
            raise ApiError(400, f"n={body.get('n')}: behind the router a request carries one sample (send n requests)",
                           param="n", code="unsupported")
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        p = backends.pick_prefill()
        got = await _unless_gone(raw, _prefill(p, path, body, headers))
        if got is _GONE:
            counts["client_gone"] += 1
            return Response(status_code=499)  # nobody reads it
        handoff, first = got
        if isinstance(first, Response):  # the prefill server's error, as it gave it
            counts["rejected" if 400 <= first.status_code < 500 else "prefill_failed"] += 1
            return first
        if handoff is None:  # its first token ended the request: the prefill answer is the answer
            counts["finished_on_prefill"] += 1
            return _as_stream(first) if body.get("stream") else JSONResponse(first)
        # a draining p stays while a decode server may still read its KV: until the decode answer ends
        # (a decode server pulls the KV after it accepts the request, not before its answer starts)
        p.handing_off += 1

        def handed_off() -> None:
            p.handing_off -= 1
            backends.settle()
        relayed = False
        try:
            answer = await _unless_gone(raw, _decode(path, {**body, "kv_transfer_params": handoff}, headers,
                                                     int(handoff.get("remote_num_tokens") or 0), handed_off))
            if answer is _GONE:  # the decode call (if any) was closed: its server aborts and frees; else free it here
                counts["client_gone"] += 1
                await _release(p, handoff, headers)
                return Response(status_code=499)
            if answer is None:
                counts["no_decode"] += 1
                await _release(p, handoff, headers)
                raise ApiError(503, "no decode server took the request (all refused or were unreachable); retry "
                               "later", type="server_error", code="no_decode_server", headers={"Retry-After": "1"})
            relayed = True  # the relay calls handed_off when the answer ends
        finally:
            if not relayed:
                handed_off()
        counts["ok"] += 1
        return answer

    async def _prefill(p: Backend, path: str, body: dict, headers: dict):
        pbody = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True},
                 "min_tokens": min(body.get("min_tokens") or 0, 1)}
        if "max_completion_tokens" in body:
            pbody["max_completion_tokens"] = 1
        pbody.pop("stream_options", None)
        p.in_flight += 1
        try:
            r = await client.post(f"{p.url}{path}", json=pbody, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise ApiError(502, f"the prefill server {p.url} failed: {type(e).__name__}: {e}", type="server_error",
                           code="prefill_unreachable") from None
        finally:
            p.in_flight -= 1
        if r.status_code != 200:
            return None, Response(r.content, status_code=r.status_code, media_type="application/json",
                                  headers={k: v for k, v in r.headers.items() if k.lower() == "retry-after"})
        answer = r.json()
        return answer.get("kv_transfer_params"), answer

    async def _decode(path: str, body: dict, headers: dict, prompt_tokens: int, on_end) -> Response | None:
        for d in backends.decode_order(prompt_tokens):
            d.in_flight += 1
            try:
                req = client.build_request("POST", f"{d.url}{path}", json=body, headers=headers, timeout=timeout_s)
                r = await client.send(req, stream=True)
            except httpx.HTTPError as e:
                d.in_flight -= 1
                logger.warning("decode server %s failed the call: %s: %s", d.url, type(e).__name__, e)
                continue
            except BaseException:  # cancelled: the client left
                d.in_flight -= 1
                raise
            if r.status_code in _RETRY:
                await r.aclose()
                d.in_flight -= 1
                continue
            return _relay(r, d, on_end)
        return None

    def _relay(r: httpx.Response, d: Backend, on_end) -> Response:
        sse = (r.headers.get("content-type") or "").startswith("text/event-stream")

        async def chunks():
            tail = b""
            try:
                async for c in r.aiter_raw():
                    if not sse:
                        yield c
                        continue
                    # NOTE: whole events only, so that a stream cut mid-event still parses up to its error event
                    tail += c
                    whole, sep, tail = tail.rpartition(b"\n\n")
                    if sep:
                        yield whole + sep
            except httpx.HTTPError as e:  # the decode server died or hung up mid-answer
                logger.warning("decode server %s broke off an answer: %s: %s", d.url, type(e).__name__, e)
                if sse:
                    err = ApiError(502, f"the decode server {d.url} broke off the answer: {type(e).__name__}",
                                   type="server_error", code="decode_server_failed")
                    yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
            finally:  # the client left, or the answer ended: the decode server sees the stream close
                await r.aclose()
                d.in_flight -= 1
                on_end()  # settles the membership too

        return StreamingResponse(chunks(), status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def _release(p: Backend, handoff: dict, headers: dict) -> None:
        try:
            await client.post(f"{p.url}/v1/kv_transfer/release", json=handoff, headers=headers, timeout=5.0)
        except httpx.HTTPError:  # its lease frees it anyway
            pass

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await route("/v1/chat/completions", raw)

    add_admin_routes(app, backends)
    app.add_middleware(ApiKeyAuth, api_key=api_key)
    return app


async def _unless_gone(raw: Request, call):
    """``call``'s result, or ``_GONE`` if the client disconnects first (``call`` is then cancelled,
    which closes its connection: the server it was talking to sees the client leave)."""
    work = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the router itself is stopping
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        pass
    return _GONE


async def _disconnect(raw: Request) -> None:
    """Returns when the client has disconnected (its body is read: the next message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _as_stream(answer: dict) -> StreamingResponse:
    """A whole answer as the SSE a streaming client expects: one chunk per choice, then [DONE]."""
    chat = answer.get("object") == "chat.completion"
    head = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for c in answer.get("choices", []):
        piece = {"index": c["index"], "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason"),
                 "stop_reason": c.get("stop_reason")}
        if chat:
            piece["delta"] = {"role": "assistant", "content": c["message"]["content"]}
        else:
            piece["text"] = c.get("text", "")
        events.append(f"data: {json.dumps({**head, 'choices': [piece]})}\n\n")
    events.append("data: [DONE]\n\n")
    return StreamingResponse(iter(events), media_type="text/event-stream")
