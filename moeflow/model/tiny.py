"""The embedded models: deterministic random-weight checkpoints in Hugging Face format.

``tiny`` is Qwen3-MoE-shaped; ``tiny-mla`` DeepSeek-V3-shaped (``tiny_config.py``). ``tiny`` was
sized for one CPU core in bf16: a 1k-token prompt prefills in about 1.35 s, and at 2k tokens one
layer's attention (projections + causal softmax) and its routed experts each take ~0.21 s (the
expert width, 640, was chosen for that balance: it is what makes disaggregation pay off).
Each is written once, then read back through the real loader like any other checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from moeflow.model.tiny_config import EMBEDDED, TINY_HF_CONFIG, TINY_VERSION  # noqa: F401  (re-exported)


def _tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)  # generated here and saved: host tensors
    h, v = cfg["hidden_size"], cfg["vocab_size"]

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cpu") * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16, device="cpu")

    def mlp(prefix: str, f: int) -> dict:
        return {f"{prefix}gate_proj.weight": rnd(f, h), f"{prefix}up_proj.weight": rnd(f, h),
                f"{prefix}down_proj.weight": rnd(h, f)}

    deepseek = cfg["model_type"] == "deepseek_v3"
    e = cfg["n_routed_experts"] if deepseek else cfg["num_experts"]
    f = cfg["moe_intermediate_size"]
    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": ones(h), "lm_head.weight": rnd(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({f"{p}input_layernorm.weight": ones(h), f"{p}post_attention_layernorm.weight": ones(h)})
        t.update(_mla(cfg, p + "self_attn.", rnd, ones) if deepseek else _gqa(cfg, p + "self_attn.", rnd, ones))
        if deepseek and i < cfg["first_k_dense_replace"]:
            t.update(mlp(f"{p}mlp.", cfg["intermediate_size"]))
            continue
        t[f"{p}mlp.gate.weight"] = rnd(e, h)
        if deepseek:
            t[f"{p}mlp.gate.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32, device="cpu")
            t.update(mlp(f"{p}mlp.shared_experts.", cfg["n_shared_experts"] * f))
        for x in range(e):
            t.update(mlp(f"{p}mlp.experts.{x}.", f))
    return t


def _gqa(cfg: dict, p: str, rnd, ones) -> dict:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {f"{p}q_proj.weight": rnd(q, h), f"{p}k_proj.weight": rnd(kv, h), f"{p}v_proj.weight": rnd(kv, h),
            f"{p}o_proj.weight": rnd(h, q), f"{p}q_norm.weight": ones(d), f"{p}k_norm.weight": ones(d)}


def _mla(cfg: dict, p: str, rnd, ones) -> dict:
    h, n, rq, rkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return {f"{p}q_a_proj.weight": rnd(rq, h), f"{p}q_a_layernorm.weight": ones(rq),
            f"{p}q_b_proj.weight": rnd(n * (dn + dr), rq), f"{p}kv_a_proj_with_mqa.weight": rnd(rkv + dr, h),
            f"{p}kv_a_layernorm.weight": ones(rkv), f"{p}kv_b_proj.weight": rnd(n * (dn + dv), rkv),
            f"{p}o_proj.weight": rnd(h, n * dv)}


def write_tiny(path: str, seed: int = 0, overrides: dict | None = None, base: dict = TINY_HF_CONFIG) -> str:
    """Write the checkpoint to ``path`` (atomically: concurrent writers cannot leave half a model)."""
    cfg = {**base, **(overrides or {})}
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


def tiny_path(cache_dir: str, name: str = "tiny") -> str:
    """An embedded model's directory (``EMBEDDED``: "tiny", "tiny-mla"), written on first use."""
    cfg, version = EMBEDDED[name]
    path = os.path.join(cache_dir, f"{name}-v{version}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_tiny(path, base=cfg)
    return path
