"""Chat messages -> prompt: the tokenizer's own chat template when it has one, else a plain one.

The plain template (used by the embedded ``tiny`` model and any checkpoint without a template)
writes each message as ``<|role|>\\n{content}\\n`` and ends with ``<|assistant|>\\n``, the cue for
the reply. For example ``[system "Be brief.", user "Hi"]`` becomes::

    <|system|>
    Be brief.
    <|user|>
    Hi
    <|assistant|>

vLLM's options apply to both: ``add_generation_prompt=False`` leaves the cue out,
``continue_final_message=True`` leaves the last message open (no end after its content) for the
model to go on with, and ``add_special_tokens`` adds the tokenizer's BOS and the like to the text
(by default only for the plain template: a model's own template writes the ones it wants).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]


def plain_template(messages: list[dict], add_generation_prompt: bool = True,
                   continue_final_message: bool = False) -> str:
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    if continue_final_message and messages:
        return text[:-1]
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool | None = None,
                template_kwargs: dict | None = None) -> ChatPrompt:
    """``messages``: [{"role", "content"}]. Raises ValueError for a conversation the template refuses."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(template_kwargs or {}))
        except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and the like
            raise ValueError(f"the model's chat template refused the messages: {e}") from e
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))))
    text = plain_template(messages, add_generation_prompt, continue_final_message)
    if add_special_tokens is False:
        return ChatPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))
    return ChatPrompt(text, list(tokenizer.encode(text)))
