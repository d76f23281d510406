"""Chat messages -> prompt: the tokenizer's own chat template when it has one, else a plain one.

The plain template (used by the embedded ``tiny`` model and any checkpoint without a template)
writes each message as ``<|role|>\\n{content}\\n`` and ends with ``<|assistant|>\\n``, the cue for
the reply. For example ``[system "Be brief.", user "Hi"]`` becomes::

    <|system|>
    Be brief.
    <|user|>
    Hi
    <|assistant|>
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]


def plain_template(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def render_chat(tokenizer, messages: list[dict]) -> ChatPrompt:
    """``messages``: [{"role", "content"}]. Raises ValueError for a conversation the template refuses."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and the like
            raise ValueError(f"the model's chat template refused the messages: {e}") from e
        # the template already wrote any BOS it wants
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))
    text = plain_template(messages)
    return ChatPrompt(text, list(tokenizer.encode(text)))
