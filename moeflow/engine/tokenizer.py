"""Tokenizer: the model directory's Hugging Face tokenizer, or a byte-level fallback."""
from __future__ import annotations

import os

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; other ids (the embedded model's <bos>=256, <eos>=257) decode to nothing.

    It claims no special ids of its own: end-of-sequence comes from the model's config.json.
    """

    bos_token_id = None
    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.vocab_size < 256:
            raise ValueError(f"this model has no tokenizer files and only {self.vocab_size} ids, too few for "
                             "the byte-level fallback: pass prompts as token ids")
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    chat_template = None


def load_tokenizer(model_dir: str, vocab_size: int):
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    return ByteTokenizer(vocab_size)
