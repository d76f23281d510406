"""The embedded model: deterministic, real HF format, read back through the real loader."""
from __future__ import annotations

import filecmp
import json
import os

from moeflow import LLM, SamplingParams
from moeflow.model.tiny import TINY_HF_CONFIG, tiny_path, write_tiny
from moeflow.model.tiny_config import TINY_MLA_HF_CONFIG

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

    monkeypatch.setattr(tiny, "write_tiny", lambda p, base: calls.append(p) or write_tiny(p, overrides=SMALL))
    p1 = tiny_path(str(tmp_path))
    p2 = tiny_path(str(tmp_path))
    assert p1 == p2 and len(calls) == 1
    assert TINY_HF_CONFIG["vocab_size"] >= 258  # the byte tokenizer's ids fit


SMALL_MLA = {"num_hidden_layers": 2, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
             "hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
             "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32}


def test_tiny_mla_is_a_deepseek_checkpoint_transformers_reads_alike(tmp_path):
    """The DeepSeek-shaped embedded model, shrunk: written by moeflow, read by both moeflow and
    transformers' DeepseekV3ForCausalLM with the same logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    path = write_tiny(str(tmp_path / "mla"), overrides=SMALL_MLA, base=TINY_MLA_HF_CONFIG)
    prompt = list(b"hello world")
    with LLM(path, dtype="float32") as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1,
                                                    ignore_eos=True))[0]
        assert llm.engine.model_config.attention_kind == "mla" and llm.engine.model_config.n_group == 2
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    for i, (d, t) in enumerate(zip(out.prompt_logprobs[1:], prompt[1:])):
        assert abs(d[t].logprob - ref[i, t].item()) < 1e-4
