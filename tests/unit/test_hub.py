"""Models by hub name: ``LLM("org/name")`` resolves through the Hugging Face cache (offline here:
the test populates the cache the way huggingface_hub lays it out), with revisions."""
from __future__ import annotations

import os
import shutil

import pytest

from moeflow import LLM, SamplingParams
from moeflow.config import ConfigError
from moeflow.engine.llm import resolve_model


def _cache(root, repo: str, src: str, commit: str, ref: str = "main") -> None:
    repo_dir = os.path.join(root, "models--" + repo.replace("/", "--"))
    shutil.copytree(src, os.path.join(repo_dir, "snapshots", commit))
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    with open(os.path.join(repo_dir, "refs", ref), "w") as f:
        f.write(commit)


def test_hub_names_resolve_offline_from_the_cache(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cache(tmp_path, "acme/moe-small", checkpoints("qwen3").path, "a" * 40)
    _cache(tmp_path, "acme/moe-small", checkpoints("deepseek_v3").path, "b" * 40, ref="v2")
    path = resolve_model("acme/moe-small")
    assert path.endswith("a" * 40) and os.path.isfile(os.path.join(path, "config.json"))
    assert resolve_model("acme/moe-small", revision="v2").endswith("b" * 40)
    with LLM("acme/moe-small", dtype="float32") as llm:
        assert llm.engine.model_config.architecture == "Qwen3MoeForCausalLM"
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        resolve_model("acme/missing")
    with pytest.raises(ConfigError, match="not a directory, an embedded model"):
        resolve_model("no-such-dir")
    assert resolve_model(checkpoints("qwen3").path) == checkpoints("qwen3").path  # a directory is itself
