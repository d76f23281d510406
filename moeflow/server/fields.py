"""What the server does with every request field it declares (OpenAI's and vLLM's): honoured,
refused unless at its neutral value, or accepted without effect — never silently ignored.

``protocol.py`` declares the fields (their types) and honours the ``HONOURED`` ones; a field in
``REFUSED`` is accepted at its neutral value (the one that asks for nothing: null, false, [],
the default) and answered with a 400 naming it otherwise; ``NO_EFFECT`` fields only inform (and
say why that is harmless). docs/serving.md shows the same table to users, and
tests/unit/test_protocol_fields.py checks that every declared field is in exactly one class.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeflow.server.errors import not_supported


def _empty(value: Any, body: Any) -> bool:
    return value is None or value is False or value in ("", [], {})


@dataclass(frozen=True)
class Refused:
    why: str  # completes "<field>=<value> is not supported: ..."
    neutral: Callable[[Any, Any], bool] = _empty  # (value, body) -> True when it asks for nothing


def _equals(*values) -> Callable[[Any, Any], bool]:
    return lambda v, body: v is None or any(v == x and type(v) is type(x) for x in values)


_GUIDED = "guided (structured) decoding is not implemented"
REFUSED: dict[str, Refused] = {
    # OpenAI
    "best_of": Refused("only the n samples asked for are drawn (best_of must be null or n)",
                       lambda v, body: v is None or v == body.n),
    "echo": Refused("the answer never repeats the prompt (or, in chat, the last message)"),
    "suffix": Refused("insertion (text after the completion) is not implemented"),
    "response_format": Refused(_GUIDED + '; only {"type": "text"} is accepted',
                               lambda v, body: v is None or v == {"type": "text"}),
    "tools": Refused('nothing calls a tool; tools are accepted only with tool_choice "none"',
                     lambda v, body: not v or body.tool_choice == "none"),
    "tool_choice": Refused('tool calling is not implemented; only "none" is accepted', _equals("none")),
    "functions": Refused('function calling is not implemented (accepted only with function_call "none")',
                         lambda v, body: not v or body.function_call == "none"),
    "function_call": Refused('function calling is not implemented; only "none" is accepted', _equals("none")),
    "audio": Refused("the model writes text only"),
    "modalities": Refused('the model writes text only; only ["text"] is accepted', _equals(["text"])),
    "prediction": Refused("predicted outputs (speculative decoding) are not implemented"),
    "store": Refused("answers are not stored"),
    "reasoning_effort": Refused("no model here takes a reasoning effort"),
    "verbosity": Refused("no model here takes a verbosity"),
    "web_search_options": Refused("there is no web search"),
    "moderation": Refused("nothing here moderates the answers"),
    # vLLM
    "use_beam_search": Refused("beam search is not implemented"),
    "length_penalty": Refused("only beam search uses it, and beam search is not implemented", _equals(1.0, 1)),
    "skip_special_tokens": Refused("special tokens are always left out of the text", _equals(True)),
    "spaces_between_special_tokens": Refused("special tokens are always left out of the text", _equals(True)),
    "allowed_token_ids": Refused("restricting the vocabulary is not implemented (logit_bias is)"),
    "bad_words": Refused("banned words are not implemented (logit_bias bans single tokens)"),
    "guided_json": Refused(_GUIDED),
    "guided_regex": Refused(_GUIDED),
    "guided_choice": Refused(_GUIDED),
    "guided_grammar": Refused(_GUIDED),
    "guided_decoding_backend": Refused(_GUIDED),
    "guided_whitespace_pattern": Refused(_GUIDED),
    "structural_tag": Refused(_GUIDED),
    "structured_outputs": Refused(_GUIDED),
    "chat_template": Refused("the server renders chats with the model's own template only"),
    "documents": Refused("retrieval documents for the chat template are not implemented"),
    "mm_processor_kwargs": Refused("the models served here take text only"),
    "priority": Refused("the scheduler has no priorities (priority must be 0)", _equals(0)),
    "logits_processors": Refused("custom logits processors are not loaded"),
    "kv_transfer_params": Refused("this server has no prefill/decode role (moeflow serve --role prefill or decode, "
                                  "behind moeflow router)"),
    "vllm_xargs": Refused("no extension reads extra arguments"),
    "prompt_embeds": Refused("prompts are text or token ids, not embeddings"),
    "include_reasoning": Refused("no reasoning parser splits the output", _equals(True)),
}

# field -> why accepting it without effect is harmless
NO_EFFECT: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; nothing here monitors",
    "metadata": "tags for stored answers; answers are not stored",
    "service_tier": "there is one tier",
    "prompt_cache_key": "a routing hint for a provider's prompt cache; there is no cache across requests",
    "safety_identifier": "an end-user id for the provider's abuse monitoring; nothing here monitors",
    "cache_salt": "salts a prefix cache shared across requests; there is none",
    "parallel_tool_calls": "no tool is ever called",
    "prompt_cache_options": "options of a provider's prompt cache; there is no cache across requests",
    "prompt_cache_retention": "how long a provider keeps its prompt cache; there is none",
}

HONOURED: frozenset[str] = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "logprobs", "top_logprobs", "prompt_logprobs", "return_tokens_as_token_ids", "add_special_tokens",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "truncate_prompt_tokens",
    "request_id",
})


def check_refused(body) -> None:
    """Raise the 400 for the first declared field that is refused and not at its neutral value."""
    declared = type(body).model_fields
    for name, rule in REFUSED.items():
        if name in declared and not rule.neutral(getattr(body, name), body):
            raise not_supported(name, f"{name}={_show(getattr(body, name))} is not supported: {rule.why}")


def _show(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."
