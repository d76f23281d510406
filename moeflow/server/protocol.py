"""Request bodies in the OpenAI shape, with vLLM's extensions.

Every field of OpenAI's /v1/completions and /v1/chat/completions and of vLLM's OpenAI server is
declared here and honoured, refused unless at its neutral value, or accepted without effect
(``fields.py`` has the table). Types are strict (``"5"`` is not an int) and checked here;
*values* are checked by the engine's own ``SamplingParams`` and ``validate_request``, so range
messages name the numbers once, in one place (``_documented`` only writes the ranges into the
OpenAPI schema); this file checks only the server's own caps (``MAX_N``, ``MAX_STOP``,
``MAX_LOGPROBS``). Unknown fields are accepted and ignored, as vLLM does, with one warning per
request naming them.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeflow.core import SamplingParams
from moeflow.server.errors import ApiError, bad_request, not_supported
from moeflow.server.fields import check_refused

logger = logging.getLogger("moeflow.server")

MAX_N = 128  # samples per request: each is a request in the engine (and counts toward admission)
MAX_STOP = 16  # stop strings per request (OpenAI allows 4, vLLM any number)
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's and vLLM's default cap)


def _documented(default=None, **json_schema):
    """A field whose range the OpenAPI schema states but pydantic does not enforce (the engine does)."""
    return Field(default, json_schema_extra=json_schema)


def _required(**json_schema):
    """A required field whose bounds the schema states (the server checks them, naming the field)."""
    return Field(json_schema_extra=json_schema)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Fields received that neither this body nor its nested ones declare ("messages.0.foo")."""
        out = [prefix + k for k in self.model_extra or {}]
        for name in type(self).model_fields:
            v = getattr(self, name)
            for i, x in (enumerate(v) if isinstance(v, list) else [(None, v)]):
                if isinstance(x, _Body):
                    out += x.unknown_fields(f"{prefix}{name}." + ("" if i is None else f"{i}."))
        return out


class StreamOptions(_Body):
    include_usage: bool | None = False  # a last chunk with empty choices carries the usage
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far too


class _Sampling(_Body):
    model: str | None = None  # None: the served model
    temperature: float | None = _documented(minimum=0)  # None: 1.0
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(minimum=-1)  # -1 or 0: all tokens
    min_p: float | None = _documented(minimum=0, maximum=1)
    seed: int | None = _documented(minimum=-2**63, maximum=2**64 - 1)
    n: int = _documented(1, minimum=1, maximum=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = _documented(maxItems=MAX_STOP)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = _documented(0, minimum=0)
    presence_penalty: float | None = _documented(0.0, minimum=-2, maximum=2)
    frequency_penalty: float | None = _documented(0.0, minimum=-2, maximum=2)
    repetition_penalty: float | None = _documented(minimum=0.01, maximum=100)  # None: 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    prompt_logprobs: int | None = _documented(minimum=0, maximum=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = _documented(minimum=1)  # keep the prompt's last k tokens
    request_id: str | None = None  # the answer's id (after "cmpl-"/"chatcmpl-"); None: a random one
    user: str | None = None
    cache_salt: str | None = None
    # refused unless neutral (fields.REFUSED)
    best_of: int | None = None
    echo: bool | None = _documented(False, enum=[False, None])
    use_beam_search: bool = _documented(False, enum=[False])
    length_penalty: float = 1.0
    skip_special_tokens: bool = _documented(True, enum=[True])
    spaces_between_special_tokens: bool = _documented(True, enum=[True])
    allowed_token_ids: list[int] | None = _documented(maxItems=0)
    bad_words: list[str] | None = _documented(maxItems=0)
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = _documented(0, enum=[0])
    logits_processors: list[str | dict[str, Any]] | None = _documented(maxItems=0)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float] | None = None

    def check_supported(self) -> None:
        """Warn of unknown fields; refuse, naming the field, what the engine cannot do."""
        unknown = self.unknown_fields()
        if unknown:
            logger.warning("request fields ignored (neither OpenAI's nor vLLM's): %s", ", ".join(unknown))
        check_refused(self)
        if self.n > MAX_N:
            raise bad_request(f"n={self.n} is over this server's limit of {MAX_N} samples per request", param="n")
        if len(self.stop_strings) > MAX_STOP:
            raise bad_request(f"{len(self.stop_strings)} stop strings are over this server's limit of {MAX_STOP}",
                              param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs is not None:
            if self.stream:
                raise not_supported("prompt_logprobs", "prompt_logprobs are not available with stream=true (as vLLM)")
            _check_top_n("prompt_logprobs", self.prompt_logprobs)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise bad_request(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}",
                              param="truncate_prompt_tokens")
        self.token_bias()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys (JSON strings) as token ids."""
        bad = next((k for k in self.logit_bias or {} if not re.fullmatch(r"-?\d+", k)), None)
        if bad is not None:
            raise bad_request(f"logit_bias keys are token ids, got {bad!r}", param="logit_bias")
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def truncated(self, ids: list[int]) -> list[int]:
        k = self.truncate_prompt_tokens
        return ids[-k:] if k is not None else ids

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per output token; None: no logprobs."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        kw = dict(max_tokens=max_tokens, n=self.n, seed=self.seed, stop=self.stop_strings,
                  include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                  presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                  logit_bias=self.token_bias(), logprobs=self.num_logprobs, prompt_logprobs=self.prompt_logprobs)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return SamplingParams(**kw)


def _check_top_n(param: str, n: int) -> None:
    if not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {n}", param=param)


class CompletionRequest(_Sampling):
    # NOTE: JSON Schema applies minLength to a string and minItems to an array: an empty prompt either way is refused
    prompt: str | list[int] | list[str] | list[list[int]] = _required(minLength=1, minItems=1)
    max_tokens: int | None = _documented(minimum=1)  # None: 16, as OpenAI
    logprobs: int | None = _documented(minimum=0, maximum=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM: BOS and the like added to a text prompt
    suffix: str | None = _documented(maxLength=0)  # refused unless empty
    prompt_embeds: str | list[str] | None = _documented(maxItems=0, maxLength=0)  # refused

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            _check_top_n("logprobs", self.logprobs)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt as a string or token ids; a batch of one is unwrapped, larger batches refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise not_supported("prompt", f"a batch of {len(p)} prompts is not supported; send one per request")
            return p[0]
        return p

    def prompt_ids(self, tokenizer) -> list[int]:
        p = self.single_prompt()
        if isinstance(p, str):
            # NOTE: the default spelled as the tokenizer's default: wrappers may take the text alone
            p = tokenizer.encode(p) if self.add_special_tokens else tokenizer.encode(p, add_special_tokens=False)
        return self.truncated(list(p))


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
    messages: list[ChatMessage] = _required(minItems=1)
    max_tokens: int | None = _documented(minimum=1)  # None: the rest of the context
    max_completion_tokens: int | None = _documented(minimum=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = _documented(minimum=0, maximum=MAX_LOGPROBS)  # needs logprobs=true
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's cue
    continue_final_message: bool = False  # vLLM: leave the last message open for the model to go on
    add_special_tokens: bool | None = None  # vLLM; None: as the template (a model's own adds none)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: passed to the model's chat template
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    # refused unless neutral (fields.REFUSED)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    store: bool | None = _documented(enum=[False, None])
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        if self.top_logprobs is not None:
            _check_top_n("top_logprobs", self.top_logprobs)
            if self.top_logprobs > 0 and not self.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message=true needs add_generation_prompt=false (the two end the "
                              "prompt differently)", param="continue_final_message")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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

