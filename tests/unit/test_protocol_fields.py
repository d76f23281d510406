"""Every request field the server declares is honoured, refused unless neutral, or accepted
without effect (``moeflow/server/fields.py``); every field of the installed openai client's
create params, and of vLLM's OpenAI server, is declared; a refused field at a value that asks
for something is a 400 naming it, at its neutral value it passes; unknown fields are logged."""
from __future__ import annotations

import logging
import typing

import pytest
from openai.types import completion_create_params as openai_completions
from openai.types.chat import completion_create_params as openai_chat

from moeflow.server.errors import ApiError
from moeflow.server.fields import HONOURED, NO_EFFECT, REFUSED
from moeflow.server.protocol import ChatCompletionRequest, CompletionRequest

BODIES = {CompletionRequest: {"prompt": "hi"}, ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]}}

# vLLM's OpenAI server's sampling and chat extensions (its protocol.py, 0.11), besides OpenAI's
VLLM_EXTENSIONS = {
    "both": ["use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
             "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
             "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
             "bad_words", "add_special_tokens", "response_format", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
             "structural_tag", "structured_outputs", "priority", "request_id", "logits_processors",
             "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"],
    CompletionRequest: ["prompt_embeds"],
    ChatCompletionRequest: ["add_generation_prompt", "continue_final_message", "chat_template",
                            "chat_template_kwargs", "documents", "mm_processor_kwargs", "include_reasoning"],
}


def _openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("body", [CompletionRequest, ChatCompletionRequest], ids=["completions", "chat"])
def test_every_declared_field_is_in_exactly_one_class(body):
    for name in body.model_fields:
        classes = [name in HONOURED, name in REFUSED, name in NO_EFFECT]
        assert sum(classes) == 1, (name, classes)


@pytest.mark.parametrize("body,module", [(CompletionRequest, openai_completions), (ChatCompletionRequest, openai_chat)],
                         ids=["completions", "chat"])
def test_openai_and_vllm_fields_are_all_declared(body, module):
    wanted = _openai_fields(module) | set(VLLM_EXTENSIONS["both"]) | set(VLLM_EXTENSIONS[body])
    assert sorted(wanted - set(body.model_fields)) == []


# a value asking for what the server refuses, per refused field
ASKING = {
    "best_of": 3, "echo": True, "suffix": "end", "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "store": True,
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {"search_context_size": "low"}, "moderation": {"model": "m"},
    "use_beam_search": True, "length_penalty": 0.5, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "allowed_token_ids": [1, 2], "bad_words": ["no"],
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "g",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "structural_tag": "{}",
    "structured_outputs": {"json": {}}, "chat_template": "{{ messages }}", "documents": [{"text": "d"}],
    "mm_processor_kwargs": {"a": 1}, "priority": 1, "logits_processors": ["p"], "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "include_reasoning": False,
}


def _refused_cases():
    for body in BODIES:
        for name in REFUSED:
            if name in body.model_fields:
                yield pytest.param(body, name, id=f"{body.__name__}-{name}")


def test_every_refused_field_has_a_case():
    assert sorted(set(REFUSED) - set(ASKING)) == []


@pytest.mark.parametrize("body,name", list(_refused_cases()))
def test_a_refused_field_is_a_400_naming_it_unless_neutral(body, name):
    req = body.model_validate({**BODIES[body], name: ASKING[name]})
    with pytest.raises(ApiError) as e:
        req.check_supported()
    assert e.value.status == 400 and e.value.param == name and e.value.code == "unsupported", e.value.message
    assert "not supported" in e.value.message
    body.model_validate(BODIES[body]).check_supported()  # the default is neutral


@pytest.mark.parametrize("name", ["best_of", "tools", "functions", "modalities", "response_format", "priority"])
def test_neutral_values_pass(name):
    neutral = {"best_of": 1, "tools": [{"type": "function", "function": {"name": "f"}}], "functions": [{"name": "f"}],
               "modalities": ["text"], "response_format": {"type": "text"}, "priority": 0}
    extra = {"tools": {"tool_choice": "none"}, "functions": {"function_call": "none"}}.get(name, {})
    body = ChatCompletionRequest if name in ChatCompletionRequest.model_fields and name not in CompletionRequest.model_fields \
        else CompletionRequest
    body.model_validate({**BODIES[body], name: neutral[name], **extra}).check_supported()


def test_unknown_fields_are_ignored_with_one_warning(caplog):
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi", "mood": "calm"}], "frobnicate": 1, "zap": [1]})
    with caplog.at_level(logging.WARNING, logger="moeflow.server"):
        body.check_supported()
    warnings = [r.getMessage() for r in caplog.records if r.name == "moeflow.server"]
    assert len(warnings) == 1 and all(w in warnings[0] for w in ("frobnicate", "zap", "messages.0.mood")), warnings


@pytest.mark.parametrize("field,value,words", [
    ("n", 129, ["n=129", "limit of 128"]),
    ("stop", [str(i) for i in range(17)], ["17 stop strings"]),
    ("logit_bias", {"abc": 1.0}, ["token ids", "'abc'"]),
    ("logprobs", 21, ["[0, 20]"]),
    ("prompt_logprobs", 21, ["[0, 20]"]),
])
def test_server_caps_name_the_field(field, value, words):
    with pytest.raises(ApiError) as e:
        CompletionRequest.model_validate({"prompt": "hi", field: value}).check_supported()
    assert e.value.param == field and all(w in e.value.message for w in words), e.value.message


def test_sampling_params_carry_every_honoured_sampling_field():
    body = CompletionRequest.model_validate({
        "prompt": "hi", "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": "x",
        "stop_token_ids": [3], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 2,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"5": -100},
        "logprobs": 3, "prompt_logprobs": 1})
    p = body.sampling_params(8)
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (8, 2, 0.5, 0.9, 5, 0.1, 7)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos, p.min_tokens) == \
        (("x",), (3,), True, True, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (dict(p.logit_bias), p.logprobs, p.prompt_logprobs) == ({5: -100}, 3, 1)


def test_docs_serving_names_every_field_in_its_class():
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "serving.md")) as f:
        doc = f.read()
    fields = doc[doc.index("**Request fields.**"):doc.index("Every malformed request")]
    honoured, refused = fields.split("Refused unless neutral:")
    refused, no_effect = refused.split("Accepted without effect:")
    for names, part in ((HONOURED - {"model", "prompt", "messages"}, honoured), (REFUSED, refused),
                        (NO_EFFECT, no_effect)):
        assert sorted(n for n in names if f"`{n}`" not in part) == []
    for name, rule in REFUSED.items():
        assert f"| `{name}` | {rule.why} |" in refused
