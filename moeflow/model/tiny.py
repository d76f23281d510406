"""The embedded default model: a deterministic random-weight Qwen3-MoE checkpoint in HF format.

Sized for one CPU core in bf16: a 1k-token prompt prefills in about 1.35 s, and at 2k tokens one
layer's attention (projections + causal softmax) and its routed experts each take ~0.21 s (the
expert width, 640, was chosen for that balance: it is what makes disaggregation pay off).
It is written once, then read back through the real loader like any other checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from moeflow.model.tiny_config import TINY_HF_CONFIG, TINY_VERSION  # noqa: F401  (re-exported)


def _tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    f, e = cfg["moe_intermediate_size"], cfg["num_experts"]

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": ones(h), "lm_head.weight": rnd(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            f"{p}input_layernorm.weight": ones(h), f"{p}post_attention_layernorm.weight": ones(h),
            f"{p}self_attn.q_proj.weight": rnd(q, h), f"{p}self_attn.k_proj.weight": rnd(kv, h),
            f"{p}self_attn.v_proj.weight": rnd(kv, h), f"{p}self_attn.o_proj.weight": rnd(h, q),
            f"{p}self_attn.q_norm.weight": ones(d), f"{p}self_attn.k_norm.weight": ones(d),
            f"{p}mlp.gate.weight": rnd(e, h),
        })
        for x in range(e):
            t[f"{p}mlp.experts.{x}.gate_proj.weight"] = rnd(f, h)
            t[f"{p}mlp.experts.{x}.up_proj.weight"] = rnd(f, h)
            t[f"{p}mlp.experts.{x}.down_proj.weight"] = rnd(h, f)
    return t


def write_tiny(path: str, seed: int = 0, overrides: dict | None = None) -> str:
    """Write the checkpoint to ``path`` (atomically: concurrent writers cannot leave half a model)."""
    cfg = {**TINY_HF_CONFIG, **(overrides or {})}
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        save_file(_tensors(cfg, seed), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def tiny_path(cache_dir: str) -> str:
    """The embedded model's directory, written on first use."""
    path = os.path.join(cache_dir, f"tiny-v{TINY_VERSION}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_tiny(path)
    return path
