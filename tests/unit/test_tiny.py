"""The embedded model: deterministic, real HF format, read back through the real loader."""
from __future__ import annotations

import filecmp
import json
import os

from moeflow import LLM, SamplingParams
from moeflow.model.tiny import TINY_HF_CONFIG, tiny_path, write_tiny

SMALL = {"num_hidden_layers": 1, "num_experts": 4, "hidden_size": 128, "moe_intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 1}


def test_tiny_is_deterministic_and_loads(tmp_path):
    a = write_tiny(str(tmp_path / "a"), overrides=SMALL)
    b = write_tiny(str(tmp_path / "b"), overrides=SMALL)
    assert filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors"), shallow=False)
    with open(os.path.join(a, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]
    with LLM(a, dtype="float32") as llm:
        out = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == list(b"hello")
    assert len(out.outputs[0].token_ids) == 5


def test_tiny_path_writes_once(tmp_path, monkeypatch):
    calls = []
    import moeflow.model.tiny as tiny

    monkeypatch.setattr(tiny, "write_tiny", lambda p: calls.append(p) or write_tiny(p, overrides=SMALL))
    p1 = tiny_path(str(tmp_path))
    p2 = tiny_path(str(tmp_path))
    assert p1 == p2 and len(calls) == 1
    assert TINY_HF_CONFIG["vocab_size"] >= 258  # the byte tokenizer's ids fit
