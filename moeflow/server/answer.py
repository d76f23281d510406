"""Answer: the n choices of one request as their deltas arrive, as one JSON body or as SSE chunks.

Shapes follow OpenAI's, with vLLM's additions (``stop_reason``, ``prompt_logprobs``; usage that
counts the prompt once and every choice's tokens). A choice's text is the engine's when the
request has stop strings (``Delta.text``, cut where a stop string matched), else decoded here:
incrementally for a stream, in one piece for a JSON answer.
"""
from __future__ import annotations

import json

from moeflow.engine.detokenizer import IncrementalDetokenizer
from moeflow.server.logprobs import ChoiceLogprobs, TokenTexts, prompt_logprobs
from moeflow.server.stream import Delta, RawLogprobs


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Choice:
    """One of the n samples."""

    def __init__(self, index: int, tokenizer, logprobs: ChoiceLogprobs | None):
        self.index = index
        self.tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.text: str | None = None  # the engine's text (a request with stop strings) so far
        self.logprobs = logprobs
        self.prompt_logprobs: list[RawLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.kv_transfer_params: dict | None = None

    def add(self, d: Delta, streaming: bool) -> tuple[str, dict | None]:
        """Record one delta; returns its text (streaming only) and its logprobs in the answer's shape."""
        final = d.finish_reason is not None
        self.token_ids += d.token_ids
        self.prompt_logprobs += d.prompt_logprobs
        if d.text is not None:
            self.text = (self.text or "") + d.text
        if final:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.kv_transfer_params = d.kv_transfer_params
        new = ""
        if streaming:
            new = d.text if d.text is not None else self._detok.add(list(d.token_ids), final=final)
        lps = None
        if self.logprobs is not None and d.token_ids:
            lps = self.logprobs.add(d.token_ids, d.logprobs)
        return new, lps

    def whole_text(self) -> str:
        if self.text is not None:
            return self.text
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)


class Answer:
    def __init__(self, kind: str, head: dict, tokenizer, body, num_prompt_tokens: int):
        self.chat = kind == "chat.completion"
        self.head = {**head, "object": kind}
        self.chunk_head = {**head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        self.texts = TokenTexts(tokenizer)
        top_n, as_ids = body.num_logprobs, bool(body.return_tokens_as_token_ids)
        self.choices = [Choice(i, tokenizer, None if top_n is None else
                               ChoiceLogprobs(self.texts, top_n, self.chat, as_ids)) for i in range(body.n)]
        self.num_prompt_tokens = num_prompt_tokens
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.include_usage, self.continuous_usage = body.include_usage, body.continuous_usage

    def usage(self, choice: Choice | None = None) -> dict:
        """Every choice's tokens, or (vLLM's continuous usage) one choice's so far."""
        done = len(choice.token_ids) if choice is not None else sum(len(c.token_ids) for c in self.choices)
        n = self.num_prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}

    # -- a JSON answer ------------------------------------------------------------------------

    def add(self, index: int, d: Delta) -> None:
        self.choices[index].add(d, streaming=False)

    def body(self) -> dict:
        choices = [self._whole_choice(c) for c in self.choices]
        out = {**self.head, "choices": choices, "usage": self.usage()}
        kv = self.choices[0].kv_transfer_params
        if kv is not None:  # a prefill server's handoff (one choice): what the decode server takes (vLLM's key)
            out["kv_transfer_params"] = kv
        if self.chat and self.want_prompt_logprobs:  # vLLM: chat's are the answer's, completions' the choice's
            out["prompt_logprobs"] = prompt_logprobs(self.texts, self.choices[0].prompt_logprobs)
        return out

    def _whole_choice(self, c: Choice) -> dict:
        logprobs = None if c.logprobs is None else c.logprobs.whole()
        if self.chat:
            out = {"index": c.index, "message": {"role": "assistant", "content": c.whole_text()}}
        else:
            out = {"index": c.index, "text": c.whole_text()}
        out.update(logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if not self.chat and self.want_prompt_logprobs:
            out["prompt_logprobs"] = prompt_logprobs(self.texts, self.choices[0].prompt_logprobs)
        return out

    # -- an SSE stream ------------------------------------------------------------------------

    def opening(self) -> list[str]:
        """Chat's first chunk of each choice names the role."""
        if not self.chat:
            return []
        return [self._chunk(c, {"role": "assistant", "content": ""}, None) for c in self.choices]

    def chunk(self, index: int, d: Delta) -> str | None:
        """The chunk of one delta; None when it carries nothing a client sees (a prefill's)."""
        c = self.choices[index]
        text, lps = c.add(d, streaming=True)
        # NOTE: a chunk per step that produced tokens, even when they decode to no text yet
        # (part of a UTF-8 character, or held back as the start of a stop string): clients time
        # tokens by chunks (TTFT, ITL)
        if not d.token_ids and d.finish_reason is None:
            return None
        if self.chat:
            return self._chunk(c, {"content": text} if text else {}, lps)
        return self._chunk(c, text, lps)

    def closing(self) -> list[str]:
        return [sse({**self.chunk_head, "choices": [], "usage": self.usage()})] if self.include_usage else []

    def _chunk(self, c: Choice, content, lps) -> str:
        piece = {"index": c.index}
        piece["delta" if self.chat else "text"] = content
        piece.update(logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        out = {**self.chunk_head, "choices": [piece]}
        if self.include_usage:
            out["usage"] = self.usage(c) if self.continuous_usage else None
        return sse(out)
