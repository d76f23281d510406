"""Guards that run before any route: the API key, then the body-size limit (plain ASGI).

The body limit reads the whole body up front (at most ``max_body_bytes``) and replays it to the
app, so an oversized body gets 413 before a byte of it is parsed, whether it announced its size
(Content-Length) or streamed it chunked. Either guard reads a refused body to its end (up to a
bound) and drops it before its 401 or 413 goes out, so that every client gets to read the answer:
see ``_refuse``.
"""
from __future__ import annotations

import asyncio
import hmac
import time

from moeflow.server.errors import ApiError

_OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers' probes)
# A refused body is drained up to this many bytes, for at most this long; past either the answer goes
# out at once with "Connection: close" (reading gigabytes or a trickle to be polite is not worth it).
_DRAIN_MAX_BYTES = 64 << 20
_DRAIN_TIMEOUT_S = 10.0


async def _refuse(response, scope, receive, send, body_pending: bool) -> None:
    """Send ``response`` for a request whose body the server will not use, after reading the rest of it.

    NOTE: answering and closing while the client is still sending makes the kernel reset the
    connection (closing a socket with unread data sends RST). A client that writes the whole body
    before it reads, and asks for "Connection: close" (Python's urllib), then gets a broken pipe
    instead of the answer; curl, requests and httpx happen to cope. So the body is read to its end
    and dropped first. A client waiting for "100 Continue" has sent nothing: it is answered at once
    and never sends the body (uvicorn sends 100 only when the app first reads).
    """
    headers = dict(scope["headers"])
    expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"
    declared = headers.get(b"content-length", b"")
    too_long = declared.isdigit() and int(declared) > _DRAIN_MAX_BYTES  # known not to fit: do not start
    drained, deadline = 0, time.monotonic() + _DRAIN_TIMEOUT_S
    while body_pending and not expects_continue and not too_long:
        left_s = deadline - time.monotonic()
        if drained > _DRAIN_MAX_BYTES or left_s <= 0:
            break
        try:
            msg = await asyncio.wait_for(receive(), left_s)
        except asyncio.TimeoutError:
            break
        if msg["type"] != "http.request":  # the client left: nobody reads the answer
            return
        drained += len(msg.get("body", b""))
        body_pending = msg.get("more_body", False)
    if body_pending:  # unread bytes are on their way: do not wait for them on this connection
        response.headers["connection"] = "close"
    await response(scope, receive, send)


class ApiKeyAuth:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        # RFC 7235: the scheme is case-insensitive ("bearer KEY" is as good as "Bearer KEY")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            err = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            return await _refuse(err.response(), scope, receive, send, body_pending=True)
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
            return await _refuse(self._too_large(f"{int(declared)} bytes"), scope, receive, send,
                                 body_pending=int(declared) > 0)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                chunks.clear()
                return await _refuse(self._too_large(f"more than {self.max_body_bytes} bytes"), scope, receive,
                                     send, body_pending=msg.get("more_body", False))
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
