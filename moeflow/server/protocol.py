"""Request bodies in the OpenAI shape (with vLLM's extensions top_k, ignore_eos, stop_token_ids).

Types are strict (``"5"`` is not an int) and checked here; *values* are checked by the engine's
own ``SamplingParams`` and ``validate_request``, so range messages name the numbers once, in one
place (``_documented`` only writes the ranges into the OpenAPI schema). Fields the engine cannot honour are accepted at their neutral value and refused otherwise
(``unsupported``) rather than silently ignored. Unknown fields are ignored, as OpenAI's are.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moeflow.server.errors import ApiError, not_supported


def _documented(default=None, **json_schema):
    """A field whose range the OpenAPI schema states but pydantic does not enforce (the engine does)."""
    return Field(default, json_schema_extra=json_schema)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with empty choices carries the usage


class _Sampling(_Body):
    model: str | None = None  # None: the served model
    temperature: float | None = _documented(minimum=0)  # None: 1.0
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(minimum=-1)  # vLLM extension; -1 or 0: all tokens
    seed: int | None = _documented(minimum=-2**63, maximum=2**64 - 1)
    n: int = _documented(1, minimum=1, maximum=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = _documented(maxLength=0, maxItems=0)  # refused unless empty
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: float = _documented(0.0, minimum=0, maximum=0)
    frequency_penalty: float = _documented(0.0, minimum=0, maximum=0)
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse, naming the field, what the engine cannot do."""
        if self.n != 1:
            raise not_supported("n", f"n={self.n} is not supported: one choice per request")
        if self.stop:
            raise not_supported("stop", "stop strings are not supported; use stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise not_supported(name, f"{name}={getattr(self, name)!r} is not supported (no penalties)")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = _documented(minimum=1)  # None: 16, as OpenAI
    echo: bool = _documented(False, enum=[False])
    logprobs: int | None = _documented(maximum=-1)  # no integer passes: only null is accepted
    suffix: str | None = _documented(maxLength=0)
    best_of: int | None = _documented(minimum=1, maximum=1)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise not_supported("echo", "echo=true is not supported")
        if self.logprobs is not None:
            raise not_supported("logprobs", f"logprobs={self.logprobs} is not supported yet")
        if self.suffix:
            raise not_supported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise not_supported("best_of", f"best_of={self.best_of} is not supported")

    def single_prompt(self) -> str | list[int]:
        """The prompt as a string or token ids; a batch of one is unwrapped, larger batches refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise not_supported("prompt", f"a batch of {len(p)} prompts is not supported; send one per request")
            return p[0]
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = _documented(minimum=1)  # None: the rest of the context
    max_completion_tokens: int | None = _documented(minimum=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = _documented(False, enum=[False])
    top_logprobs: int | None = _documented(maximum=0)

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        if self.logprobs or self.top_logprobs:
            raise not_supported("logprobs", "logprobs are not supported yet")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: ErrorDetail
