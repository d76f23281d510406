"""The router's membership routes: prefill and decode servers registered and deregistered while it
serves (SGLang Model Gateway's ``/workers`` routes; ``moeflow router-admin`` calls them).

    GET    /workers                      every server, its role, state and requests in flight
    POST   /workers {"url": U, "worker_type": "prefill"|"decode", "wait_s": 30}
                                         checked as the servers given at start are (role, model, KV
                                         layout, weights), then chosen from the next request on
    DELETE /workers/{U}                  202: it takes no new request and leaves once none of its
                                         requests needs it (GET /workers shows it draining till then)

A refusal says why: an unknown role, a server already registered, one that does not answer in its
role or differs from the others (400), an unknown URL (404), the last serving server of a role (409).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moeflow.config import ConfigError
from moeflow.server.backends import Backends
from moeflow.server.errors import ApiError

ADD_WAIT_S = 30.0  # how long a registration waits for a server still loading, unless the call says


def add_admin_routes(app: FastAPI, backends: Backends) -> None:
    @app.get("/workers")
    async def workers():
        return {"workers": [b.to_dict() for b in backends.prefill + backends.decode]}

    @app.post("/workers")
    async def add_worker(raw: Request):
        try:
            body = await raw.json()
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ApiError(400, 'want {"url": URL, "worker_type": "prefill" or "decode"}', param="url")
        wait_s = body.get("wait_s", ADD_WAIT_S)
        if not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ApiError(400, f"wait_s must be a number of seconds >= 0, got {wait_s!r}", param="wait_s")
        try:
            b = await backends.add(body["url"], body.get("worker_type"), float(wait_s))
        except ConfigError as e:
            raise ApiError(400, str(e), code="worker_refused") from None
        return {"status": "added", **b.to_dict()}

    @app.delete("/workers/{url:path}")
    async def remove_worker(url: str):
        try:
            b = backends.remove(url)
        except KeyError as e:
            raise ApiError(404, e.args[0], code="unknown_worker") from None
        except ConfigError as e:
            raise ApiError(409, str(e), code="last_worker") from None
        gone = backends.find(b.url) is None
        return JSONResponse({"status": "removed" if gone else "draining", **b.to_dict()}, status_code=202)
