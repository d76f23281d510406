"""IncrementalDetokenizer: the text a growing list of output ids adds, for O(1) amortized work per id.

As vLLM's incremental detokenizer: of the ids seen so far it keeps only a window, ``window[:read]``
the context (ids whose text went out) and ``window[read:]`` the pending ids. Each step decodes the
window and sends what its text adds to the context's text. The context is there because decoding
is not local: a sentencepiece tokenizer drops the leading space of the first token it decodes, so
a lone "▁world" decodes to "world" but after "▁Hello" adds " world". When the window's text ends
on a whole character, the pending ids become the next context and the ids before them are dropped:
the window holds the ids since the last step whose text ended on a whole character, a few in real
text.

What may still change is not sent:
- a trailing U+FFFD: a UTF-8 character whose bytes are split across tokens decodes to U+FFFD
  until its last byte arrives (the complete characters before it are sent at once);
- any text while a run of byte-fallback tokens ``<0xHH>`` is open (special tokens, skipped, do
  not end it): a run is decoded as one byte string and every byte becomes U+FFFD if it is not valid
  UTF-8, so a later byte can still turn "A" from ``<0x41>`` into "��". vLLM accepts that mismatch;
  here the run's text waits for the run's end.
The concatenated deltas equal ``tokenizer.decode(ids, skip_special_tokens=True)`` of all ids.
NOTE: except for a tokenizer configured to "clean up tokenization spaces" (WordPiece's " ." -> "."):
its clean-up reaches back across a delta already sent. transformers never applies it to BPE.
"""
from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"  # what a UTF-8 character cut by the end of the ids decodes to
# Past this many pending ids (a run of invalid bytes, or of <eos> under ignore_eos, which adds no
# text), decoding is tried only each time the pending ids double: a hold of n ids then
# costs O(n) in all instead of O(n^2), at the price of text that arrives up to n ids late.
_BACKOFF_AFTER_IDS = 16


def _is_byte_piece(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


class IncrementalDetokenizer:
    """One request's output text, delta by delta; see the module docstring for the algorithm."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # byte-fallback tokens exist only in Hugging Face tokenizers; the byte-level fallback has none
        self._to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._window: list[int] = []  # the only ids kept: context, then pending
        self._read = 0  # window[:read] is context
        self._context_text = ""  # decode(window[:read])
        self._num_sent_chars = 0  # of the window's text, the leading characters already sent
        self._next_try = 0  # number of pending ids at which to decode again (backoff)
        self._in_byte_run = False  # the last id that has text of its own is a byte-fallback token

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text that ``token_ids`` add after all earlier ids; with ``final``, all text still held."""
        self._window += token_ids
        if self._to_tokens is not None:
            for t, token in zip(token_ids, self._to_tokens(list(token_ids))):
                if _is_byte_piece(token):
                    self._in_byte_run = True
                elif self._in_byte_run:
                    self._in_byte_run = self._is_skipped(t, token)
        num_pending = len(self._window) - self._read
        if num_pending == 0:
            return ""
        if not final and (num_pending < self._next_try or self._in_byte_run):
            return ""  # held without decoding, so that a long hold costs no more than its ids
        text = self._decode(self._window)
        complete = text.rstrip(_INCOMPLETE)
        if final or len(complete) == len(text) > len(self._context_text) and text.startswith(self._context_text):
            return self._advance(text)
        if num_pending >= _BACKOFF_AFTER_IDS:
            self._next_try = 2 * num_pending
        if not text.startswith(self._context_text):  # the new ids changed the context's text: wait
            return ""
        delta = complete[self._num_sent_chars:]
        self._num_sent_chars += len(delta)
        return delta

    def _advance(self, text: str) -> str:
        """Send the rest of ``text``; the pending ids become the context."""
        delta = text[self._num_sent_chars:]
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        self._num_sent_chars = len(self._context_text)
        self._next_try = 0
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _is_skipped(self, token_id: int, token: str | None) -> bool:
        """A special token (its text shows only when not skipping) or an id past the vocabulary."""
        if token is None:
            return True
        return self._decode([token_id]) == "" and self.tokenizer.decode([token_id]) != ""
