"""Logprobs in the answers' shapes: the legacy completions one, chat's, and vLLM's prompt_logprobs.

The engine sends, per position, ``{token id: (logprob, rank)}`` for the actual token plus the top
n (``stream.RawLogprobs``). Here ids become text, ``tokenizer.decode([id])`` as vLLM's
``decoded_token`` (or ``"token_id:<id>"`` with vLLM's ``return_tokens_as_token_ids``: texts that
collide, such as the U+FFFD of every lone non-ASCII byte, stay apart), and bytes. A logprob of
-inf is sent as -9999.0, as OpenAI and vLLM do: JSON has no infinity.
"""
from __future__ import annotations

from moeflow.engine.tokenizer import ByteTokenizer
from moeflow.server.stream import RawLogprobs

_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def _by_rank(raw: RawLogprobs) -> list[tuple[int, float]]:
    """(id, logprob) most likely first; the actual token, when outside the top n, comes last."""
    return [(t, lp) for t, (lp, _) in sorted(raw.items(), key=lambda kv: (kv[1][1], -kv[1][0]))]


class TokenTexts:
    """Token id -> text and bytes, cached: a step's top n repeat the same few ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # the byte-level fallback knows each id's own byte (id < 256), which its text (U+FFFD for
        # a lone non-ASCII byte) loses; other tokenizers give the UTF-8 of the text, as vLLM
        self._exact_bytes = isinstance(tokenizer, ByteTokenizer)
        self._texts: dict[int, str] = {}

    def text(self, t: int) -> str:
        s = self._texts.get(t)
        if s is None:
            s = self._texts[t] = self.tokenizer.decode([t])
        return s

    def name(self, t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else self.text(t)

    def bytes(self, t: int) -> list[int]:
        if self._exact_bytes:
            return [t] if 0 <= t < 256 else []
        return list(self.text(t).encode("utf-8", errors="replace"))


class ChoiceLogprobs:
    """One choice's logprobs as its tokens arrive, in the endpoint's shape.

    ``chat``: OpenAI's ``{"content": [{token, logprob, bytes, top_logprobs: [n x {token, logprob,
    bytes}]}]}``; otherwise the legacy completions shape ``{tokens, token_logprobs, top_logprobs
    (the top n plus the actual token, as a dict text -> logprob), text_offset}``, where
    ``text_offset`` is where each token's text starts in the choice's text.
    """

    def __init__(self, texts: TokenTexts, top_n: int, chat: bool, as_ids: bool):
        self.texts, self.top_n, self.chat, self.as_ids = texts, top_n, chat, as_ids
        self._offset = 0  # legacy: characters of the tokens so far
        self._all: list = []  # the entries so far (chat) or the per-token tuples (legacy)

    def add(self, token_ids: tuple[int, ...], raws: tuple[RawLogprobs, ...]) -> dict:
        """The logprobs of these tokens, in the endpoint's shape (one stream chunk's)."""
        entries = [self._entry(t, raw) for t, raw in zip(token_ids, raws)]
        self._all += entries
        return self._wrap(entries)

    def whole(self) -> dict:
        """Every token's logprobs so far (the JSON answer's)."""
        return self._wrap(self._all)

    def _entry(self, t: int, raw: RawLogprobs):
        names, as_ids = self.texts, self.as_ids
        if self.chat:
            top = [{"token": names.name(u, as_ids), "logprob": _lp(lp), "bytes": names.bytes(u)}
                   for u, lp in _by_rank(raw)[:self.top_n]]
            return {"token": names.name(t, as_ids), "logprob": _lp(raw[t][0]), "bytes": names.bytes(t),
                    "top_logprobs": top}
        name, offset = names.name(t, as_ids), self._offset
        self._offset += len(names.text(t))
        return name, _lp(raw[t][0]), {names.name(u, as_ids): _lp(lp) for u, lp in _by_rank(raw)}, offset

    def _wrap(self, entries: list) -> dict:
        if self.chat:
            return {"content": entries}
        tokens, lps, tops, offsets = (list(x) for x in zip(*entries)) if entries else ([], [], [], [])
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(texts: TokenTexts, raws: list[RawLogprobs]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing predicts it), then per
    position ``{id: {"logprob", "rank", "decoded_token"}}`` (JSON makes the ids strings)."""
    return [None] + [{t: {"logprob": _lp(lp), "rank": rank, "decoded_token": texts.text(t)}
                      for t, (lp, rank) in raw.items()} for raw in raws]
