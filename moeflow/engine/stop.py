"""StopStrings: one request's output text as it grows, cut at the first stop string (vLLM's rules).

The engine feeds it every sampled token (``Request.append_token``); it decodes incrementally
(``IncrementalDetokenizer``) and looks for the stop strings only in the text the new token added
plus the ``longest - 1`` characters before it, so a stop string that straddles tokens is found and
each token costs O(longest stop string) of searching. A stop string found before ``min_tokens``
tokens does not count (vLLM: stop strings are checked only from ``min_tokens`` on).

The text is cut before the stop string, or after it with ``include_stop_str_in_output``. Until
the request ends, the last ``longest - 1`` characters are held back from what ``take`` hands
out (without ``include_stop_str_in_output``): they may be the start of a stop string that the
next token completes, and text once streamed cannot be taken back.
"""
from __future__ import annotations

from moeflow.engine.detokenizer import IncrementalDetokenizer


class StopStrings:
    def __init__(self, tokenizer, stop: tuple[str, ...], include_in_output: bool = False):
        self.stop = stop
        self.include = include_in_output
        self._longest = max(len(s) for s in stop)
        self._detok = IncrementalDetokenizer(tokenizer)
        self.text = ""  # the output's text so far (cut at the stop string once one matched)
        self.matched: str | None = None
        self.done = False  # matched, or ended otherwise: no more text comes
        self._handed_out = 0  # characters of ``text`` that ``take`` returned

    def add(self, token_id: int, may_stop: bool) -> str | None:
        """Record one output token; returns the stop string that ends the output here, if any."""
        if self.done:
            return self.matched
        new = self._detok.add([token_id])
        if not new:
            return None
        before = len(self.text)
        self.text += new
        if not may_stop:
            return None
        # a match must end in the new text: one wholly before it was looked for (or not allowed) earlier
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, s = min(hits)  # the earliest in the text
        self.text = self.text[:i + len(s)] if self.include else self.text[:i]
        self.matched, self.done = s, True
        return s

    def finish(self) -> None:
        """The request ended for another reason (EOS, length, an error): the text still held goes out."""
        if not self.done:
            self.text += self._detok.add([], final=True)
            self.done = True

    def take(self) -> str:
        """The text not handed out yet, less what a later token could still cut off."""
        end = len(self.text)
        if not self.done and not self.include:
            end = max(self._handed_out, end - (self._longest - 1))
        out = self.text[self._handed_out:end]
        self._handed_out = end
        return out
