"""IncrementalDetokenizer against a full decode, with the three kinds of tokenizer a model directory
can bring: the byte-level fallback (the embedded ``tiny`` and the test checkpoints), a byte-level
BPE (Qwen, DeepSeek, GPT-2) and a sentencepiece-style BPE with byte fallback (Mixtral, Llama).

The two BPE tokenizers are trained here on a small multilingual corpus, saved as a model directory's
tokenizer files and loaded the way the engine loads them; nothing is downloaded.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from moeflow.engine.detokenizer import IncrementalDetokenizer
from moeflow.engine.tokenizer import ByteTokenizer, load_tokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, this is a test of streaming text!",
          "混合专家模型把每个词元送到少数几个专家。", "我们今天去公园散步，天气很好。", "emoji: 🙂🚀 café naïve résumé"] * 20

TEXTS = [
    "Hello world, this is a test.",
    "混合专家模型把每个词元送到少数几个专家。",
    "emoji 🙂🚀👩‍👩‍👧 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and café",
    "  leading spaces, a\ttab\nand a new line  ",
    "我们去公园🚀 quick 狐狸 jumps Ωmega ✓ done",
]


def _byte_level_bpe(path: str) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    t = ByteLevelBPETokenizer()
    t.train_from_iterator(CORPUS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>", "<|im_end|>"],
                          show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=t._tokenizer, eos_token="<|endoftext|>").save_pretrained(path)


def _byte_fallback_bpe(path: str) -> None:
    """Mixtral's layout: <unk> <s> </s>, then the 256 byte tokens <0x00>..<0xFF>, then the pieces;
    spaces as "▁", and the decoder that turns byte runs back into UTF-8 and strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    # a small alphabet, so that the rarer characters and every emoji fall back to bytes
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
                                  show_progress=False)
    t.train_from_iterator(CORPUS, trainer=trainer)
    spec = json.loads(t.to_str())
    trained = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in trained:
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)


@pytest.fixture(scope="module", params=["byte", "byte_level_bpe", "byte_fallback_bpe"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer(258)  # the embedded tiny model's: 256 bytes + <bos> + <eos>
    path = str(tmp_path_factory.mktemp(request.param))
    {"byte_level_bpe": _byte_level_bpe, "byte_fallback_bpe": _byte_fallback_bpe}[request.param](path)
    tok = load_tokenizer(path, vocab_size=512)
    assert type(tok).__name__ != "ByteTokenizer"
    return tok


def _vocab_size(tokenizer) -> int:
    return tokenizer.vocab_size if isinstance(tokenizer, ByteTokenizer) else len(tokenizer)


def _full(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _stream(tokenizer, steps: list[list[int]]) -> list[str]:
    """The deltas of ``steps`` (a list of ids per engine step); the last step is final."""
    d = IncrementalDetokenizer(tokenizer)
    return [d.add(ids, final=i == len(steps) - 1) for i, ids in enumerate(steps)]


def _encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer.encode(text, add_special_tokens=False)


def test_random_ids_stream_to_the_full_decode(tokenizer):
    """Any ids at all (invalid bytes, special tokens, ids past the tokenizer's vocabulary as a model
    with a padded vocabulary samples them), one or a few per step: the deltas add up to a full decode."""
    rng = random.Random(0)
    vocab = _vocab_size(tokenizer)
    for _ in range(400):
        ids = [rng.randrange(vocab + 4) for _ in range(rng.randrange(1, 60))]
        steps, i = [], 0
        while i < len(ids):
            n = 1 if rng.random() < 0.7 else rng.randrange(0, 4)  # 0: a step that produced no token
            steps.append(ids[i:i + n])
            i += n
        if rng.random() < 0.3:
            steps.append([])  # the final delta of an abort carries no token
        assert "".join(_stream(tokenizer, steps)) == _full(tokenizer, ids), ids


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_token_by_token(tokenizer, text):
    ids = _encode(tokenizer, text)
    deltas = _stream(tokenizer, [[t] for t in ids])
    assert "".join(deltas) == _full(tokenizer, ids) == text
    assert not any("\ufffd" in d for d in deltas)  # a character cut across tokens is never sent half-made
    # no later than it can be: once a step's ids end a character (and no run of byte-fallback
    # tokens is open, which a later byte could still turn into U+FFFD), all its text is out
    tokens = getattr(tokenizer, "convert_ids_to_tokens", lambda i: "")
    for i in range(len(ids)):
        if not re.fullmatch(r"<0x[0-9A-F]{2}>", tokens(ids[i])):
            assert "".join(deltas[:i + 1]) == _full(tokenizer, ids[:i + 1]).rstrip("\ufffd"), i


class _Counting:
    """The tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decode_lens: list[int] = []

    def decode(self, ids, **kwargs):
        self.decode_lens.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_work_per_token_does_not_grow_with_length(tokenizer):
    ids = _encode(tokenizer, " ".join(TEXTS) * 60)
    assert len(ids) > 2000
    counting = _Counting(tokenizer)
    d = IncrementalDetokenizer(counting)
    text = "".join(d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == _full(tokenizer, ids)
    lens = counting.decode_lens
    # a window of a few ids (at most the longest run of byte-fallback tokens here, 7 four-byte
    # characters, plus context), not all of them as re-decoding the whole output did
    assert max(lens) <= 40, max(lens)
    assert max(lens[len(lens) // 2:]) <= max(lens[:len(lens) // 10])  # the same window late as early
    assert sum(lens) <= 6 * len(ids)


@pytest.mark.parametrize("held", ["invalid bytes", "skipped special tokens"])
def test_a_long_hold_costs_linear_work(held):
    """2000 ids that add no text yet (the model babbles continuation bytes, or <eos> under
    ignore_eos): decode attempts back off, so the whole hold costs O(n), and nothing is lost."""
    tok = ByteTokenizer(258)
    filler = [0x80] * 2000 if held == "invalid bytes" else [257] * 2000
    ids = list("起点 ".encode()) + filler + list("终点 ok".encode())
    counting = _Counting(tok)
    d = IncrementalDetokenizer(counting)
    deltas = [d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(deltas) == _full(tok, ids)
    assert sum(counting.decode_lens) <= 8 * len(ids)
