"""Guards that run before any route: the API key, then the body-size limit (plain ASGI).

The body limit reads the whole body up front (at most ``max_body_bytes``) and replays it to the
app, so an oversized body gets 413 before a byte of it is parsed, whether it announced its size
(Content-Length) or streamed it chunked.
"""
from __future__ import annotations

import hmac

from moeflow.server.errors import ApiError

_OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers' probes)


class ApiKeyAuth:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            err = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(f"{int(declared)} bytes")(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large(f"more than {self.max_body_bytes} bytes")(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel: http.disconnect when the client leaves

        return await self.app(scope, replay, send)

    def _too_large(self, size: str):
        return ApiError(413, f"the request body ({size}) is over this server's limit of {self.max_body_bytes} "
                        "bytes (--max-body-bytes)", code="body_too_large").response()
