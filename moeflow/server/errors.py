"""ApiError: every failure a client sees, as an OpenAI-style body ``{"error": {message, type, param, code}}``."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from moeflow.core import RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_supported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported")


def overloaded(limit: int) -> ApiError:
    return ApiError(429, f"the server holds {limit} unfinished requests, its limit (--max-pending-requests); "
                    "retry later", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def unavailable(reason: str, retry_after_s: float | None = None) -> ApiError:
    """503; with ``retry_after_s`` (a restart under way) the client is told when to come back."""
    headers = None if retry_after_s is None else {"Retry-After": str(max(1, round(retry_after_s)))}
    return ApiError(503, f"the engine is not serving: {reason}", type="server_error", code="engine_unavailable",
                    headers=headers)


def engine_failed(reason: str) -> ApiError:
    return ApiError(500, f"the request failed in the engine: {short(reason)}", type="server_error",
                    code="engine_failed")


def short(reason: str) -> str:
    """A worker's failure carries its traceback: keep the first line and the exception line."""
    lines = [x.strip() for x in reason.strip().splitlines() if x.strip()]
    return lines[0] if len(lines) <= 1 else f"{lines[0]} {lines[-1]}"


# The field a RequestError names, for ``param``; the message itself stays the engine's.
_PARAM_PATTERNS = [
    (re.compile(r"SamplingParams: (\w+)"), None),
    (re.compile(r"^request_id: "), "request_id"),
    (re.compile(r"the prompt is empty|token id -?\d+ is outside"), "prompt"),
    (re.compile(r"exceeds max_batch_tokens|KV blocks"), "prompt"),
]


def from_request_error(e: RequestError, prompt_param: str, prompt_len: int, max_model_len: int) -> ApiError:
    msg = str(e)
    param = None
    for pattern, name in _PARAM_PATTERNS:
        m = pattern.search(msg)
        if m:
            param = name or m.group(1)
            break
    if param == "prompt":
        param = prompt_param
    elif param is None and "exceeds the model's context" in msg:
        # the prompt alone too long names the prompt; otherwise max_tokens is what pushed it over
        param = prompt_param if prompt_len >= max_model_len else "max_tokens"
    code = "context_length_exceeded" if "exceeds the model's context" in msg else "invalid_value"
    return ApiError(400, msg, param=param, code=code)
