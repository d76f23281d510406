"""The FastAPI app: OpenAI-compatible routes, /health, /metrics, and the error contract.

Every failure answer has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``:
400 for a malformed or invalid body (invalid JSON and wrong types included), 401 without the
API key, 404 for an unknown model or route, 413 for an oversized body, 429 past the admission
bound, 500 when the engine failed the request, 503 when it no longer serves.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from moeflow.config import ConfigError
from moeflow.kv_handle import RELEASED, UNKNOWN, KvHandle
from moeflow.server.async_engine import AsyncEngine
from moeflow.server.config import ServerConfig
from moeflow.server.errors import ApiError
from moeflow.server.metrics import ServerMetrics
from moeflow.server.middleware import ApiKeyAuth, BodyLimit
from moeflow.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from moeflow.server.scale import ScaleElasticEpRequest, ScaleRequest
from moeflow.server.serving import OpenAIServing

logger = logging.getLogger("moeflow.server")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}
_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error"}


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem, named by its field path ("messages.0.role: Input should be ...")."""
    errs = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    first, kind = errs[0], errs[0].get("type", "")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON: {ctx}".rstrip(": "), code="invalid_json")
    if not loc and kind == "missing":
        return ApiError(400, "the request needs a JSON body", code="missing_body")
    field = ".".join(loc) or "body"
    branches = _union_branches(errs)
    if branches:  # pydantic reports one error per member of a union: say what was accepted instead
        got = type(first.get("input")).__name__
        return ApiError(400, f"{loc[0]}: expected one of {', '.join(branches)}; got {got}", param=loc[0],
                        code="invalid_type")
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    code = "missing" if kind == "missing" else "invalid_type" if kind.endswith("_type") else "invalid_value"
    return ApiError(400, f"{field}: {first.get('msg')}{more}", param=loc[0] if loc else None, code=code)


def _union_branches(errs: list[dict]) -> list[str]:
    """The member types of a top-level union field all of whose members failed, else []."""
    locs = [[x for x in e.get("loc", ()) if x != "body"] for e in errs]
    if len(errs) < 2 or any(len(x) < 2 for x in locs) or len({x[0] for x in locs}) != 1:
        return []
    tags = list(dict.fromkeys(str(x[1]) for x in locs))
    return tags if len(tags) > 1 and all(not t.isdigit() for t in tags) else []


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="moeflow", summary="OpenAI-compatible serving of Mixture-of-Experts models",
                  version="0.1.0")
    serving = OpenAIServing(engine, config)

    def error_response(err: ApiError) -> JSONResponse:
        metrics.errors.labels(str(err.status)).inc()
        return err.response()

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):  # unknown route, wrong method
        return error_response(ApiError(exc.status_code, str(exc.detail),  # a 405's Allow header included
                                       type=_STATUS_TYPES.get(exc.status_code, "invalid_request_error"),
                                       headers=exc.headers))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.get("/health", summary="200 while the engine serves ('ok', or 'degraded' with the reason while a lost "
             "part is replaced), 503 (with the reason) after a failure or while it restarts")
    async def health():
        s = engine.snapshot()
        if s.healthy and s.degraded is not None:  # serving: 200, and says what it lost
            return {"status": "degraded", "reason": s.degraded}
        if s.healthy:
            return {"status": "ok"}
        if s.restarting:
            return JSONResponse({"status": "restarting", "reason": s.failure}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "unhealthy", "reason": s.failure}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(START_S),
                                            "owned_by": "moeflow", "max_model_len": engine.max_model_len}]}

    @app.get("/v1/kv_transfer", responses=_ERRORS, summary="a prefill or decode server's role, KV layout and "
             "free KV (moeflow router reads it to check a deployment and place requests)")
    async def kv_transfer():
        if config.role is None:
            raise ApiError(404, "this server has no prefill/decode role (moeflow serve --role)", type="not_found_error")
        s, e = engine.snapshot(), engine.llm.engine
        return {"role": config.role, "kv_layout": e.kv_layout.to_dict(), "weights": e.weights, "kv_port": e.kv_port,
                "healthy": s.healthy, "num_free_kv_blocks": s.num_free_kv_blocks, "num_kv_blocks": s.num_kv_blocks,
                "num_waiting": s.num_waiting, "num_running": s.num_running, "num_handoffs": s.num_handoffs}

    @app.post("/v1/kv_transfer/release", responses={**_ERRORS, 403: {"model": ErrorResponse}},
              summary="a prefill server's staged KV that no decode server will take (the router's, when every decode "
              "server refused it): freed before its lease ends. The body is the prefill answer's kv_transfer_params; "
              "403 unless its remote_token is the range's and no decode server has claimed it")
    async def kv_release(body: dict[str, Any]):
        if config.role != "prefill":
            raise ApiError(404, "only a prefill server (moeflow serve --role prefill) stages KV", type="not_found_error")
        try:
            handle = KvHandle.from_params(body)
        except ValueError as e:
            raise ApiError(400, f"the body must be a prefill answer's kv_transfer_params: {e}",
                           param="kv_transfer_params") from None
        try:
            outcome = await asyncio.wait_for(asyncio.wrap_future(engine.release_kv(handle)), 30.0)
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine did not take the release in time; its lease frees the KV",
                           type="server_error") from None
        if outcome == RELEASED:
            return {"released": handle.transfer_id}
        if outcome == UNKNOWN:
            raise ApiError(404, f"transfer {handle.transfer_id} is not offered by this server (any more)",
                           type="not_found_error")
        raise ApiError(403, f"transfer {handle.transfer_id}: the token is not the range's, or a decode server "
                            f"has claimed it (only it releases it)", type="permission_error")

    @app.get("/expert_distribution", responses=_ERRORS, summary="tokens per MoE layer and expert since the "
             "deployment started: save it as a file and start the next with --init-expert-location FILE")
    async def expert_distribution():
        try:
            return engine.llm.expert_distribution()
        except ConfigError as e:
            raise ApiError(404, str(e), type="not_found_error") from None

    async def _scale(fn):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(engine.call(fn)), 30.0)
        except ConfigError as e:
            raise ApiError(400, str(e), code="scale_refused") from None
        except asyncio.TimeoutError:
            raise ApiError(503, "the engine did not take the request in time", type="server_error") from None

    def _scaler():
        scale = getattr(engine.llm.engine, "scale", None)
        if scale is None:
            raise ConfigError(f"mode {engine.llm.mode!r}: its membership is fixed while serving (afd's FFN daemons "
                              f"and asap's MoE workers scale)")
        return scale

    @app.get("/scale", responses=_ERRORS, summary="the deployment's members and its scale events")
    async def scale_status():
        return await _scale(lambda: _scaler()())

    @app.post("/scale", responses=_ERRORS, summary='change the membership while serving: {"ffn": N} (afd), '
              '{"moe": E} (asap), {"ep_size": N} (either), {"attention": M}, {"prefill": X} or {"decode": Y} (pd); '
              'GET /scale follows it')
    async def scale(body: ScaleRequest):
        ep = body.ep_size if body.ep_size is not None else body.new_ep_size
        sides = {k: v for k, v in (("prefill", body.prefill), ("decode", body.decode)) if v is not None}
        if body.ffn is None and body.moe is None and ep is None and body.attention is None and not sides:
            raise ApiError(400, "give a target: ffn (afd's FFN daemons), moe (asap's MoE workers), ep_size, "
                                "attention, or prefill / decode (pd's instances)", param="ep_size")
        if sides and engine.llm.mode != "pd":
            raise ApiError(400, f"mode {engine.llm.mode!r} has no prefill or decode instances (pd has)",
                           code="scale_refused")
        return await _scale(lambda: _scaler()(ffn=body.ffn, moe=body.moe, ep_size=ep, attention=body.attention,
                                              drain=body.drain, **sides))

    @app.post("/scale_elastic_ep", responses=_ERRORS, summary='SGLang\'s: {"new_ep_size": N}, the expert '
              'devices (afd: FFN daemons; asap: MoE workers)')
    async def scale_elastic_ep(body: ScaleElasticEpRequest):
        return await _scale(lambda: _scaler()(ep_size=body.new_ep_size))

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completion(body, raw)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyAuth, api_key=config.api_key)  # added last: runs first
    return app


START_S = time.time()

