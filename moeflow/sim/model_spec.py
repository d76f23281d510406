"""What the cost model needs to know about a model: parameter counts and FLOPs per token and per
(query, key) pair, layer by layer.

A spec is derived from the engine's own ``ModelConfig``: a Hugging Face config.json goes through
the same family translation the engine's loader uses (``moeflow.model.family``, torch-free), so a
preset is a config.json, and ``model:`` in an experiment may also name a local checkpoint directory.
"""
from __future__ import annotations

import dataclasses

import json
import os
from dataclasses import dataclass

from moeflow.config import ModelConfig
from moeflow.sim.hf_configs import DEEPSEEK_R1_HF, DEEPSEEK_V32_HF, MINIMAX_M2_HF, QWEN3_235B_A22B_HF


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_dense_layers: int  # the first layers have a dense MLP instead of experts (first_k_dense_replace)
    hidden_size: int
    vocab_size: int
    num_heads: int
    attention: str = "gqa"  # "gqa" or "mla"
    num_kv_heads: int = 0  # gqa
    head_dim: int = 0  # gqa
    q_lora_rank: int = 0  # mla (0: q projected straight from the hidden state)
    kv_lora_rank: int = 0  # mla
    qk_nope_head_dim: int = 0  # mla
    qk_rope_head_dim: int = 0  # mla
    v_head_dim: int = 0  # mla
    index_heads: int = 0  # DSA lightning indexer (0: none)
    index_head_dim: int = 0
    index_topk: int = 0  # keys each query attends to under DSA (0: all, dense causal)
    num_experts: int = 1
    top_k: int = 1
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # F of the shared expert(s) of an MoE layer, all together
    dense_intermediate_size: int = 0
    weight_bytes: float = 2.0  # bytes per weight as served (2: bf16, 1: int8/fp8)
    act_bytes: float = 2.0  # bytes per activation element sent to the experts (dispatch)
    # bytes per routed-expert weight when the experts are quantized apart from the rest (NVFP4:
    # 4 bits + one FP8 scale per 16 = 0.5625); 0: weight_bytes
    expert_weight_bytes: float = 0.0
    kv_bytes: float = 2.0  # bytes per cached key/value element (2: bf16, 1: fp8)
    # bytes per element of what is never quantized: activations, combined expert outputs, and the
    # embeddings, LM head, norms and MoE gates (2: bf16; 4 where the engine computes in float32)
    base_bytes: float = 2.0
    # the MoE gate's expert-load skew on real traffic: per MoE layer, the CV of the experts' shares
    # (sim/expert_load.py; SimOptions.expert_load_cv overrides it). 0: balanced, no figure known
    gate_load_cv: float = 0.0

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"ModelSpec {self.name!r}: {msg}")

        need(self.attention in ("gqa", "mla"), f"attention must be 'gqa' or 'mla', got {self.attention!r}")
        need(self.num_layers > 0 and 0 <= self.num_dense_layers <= self.num_layers,
             f"need 0 <= num_dense_layers ({self.num_dense_layers}) <= num_layers ({self.num_layers})")
        need(self.hidden_size > 0 and self.num_heads > 0, "hidden_size and num_heads must be > 0")
        if self.attention == "gqa":
            need(self.num_kv_heads > 0 and self.head_dim > 0 and self.num_heads % self.num_kv_heads == 0,
                 "gqa needs num_kv_heads dividing num_heads, and head_dim > 0")
        else:
            need(self.kv_lora_rank > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0,
                 "mla needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
        need(1 <= self.top_k <= self.num_experts, f"need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts})")
        need(self.num_layers == self.num_dense_layers or self.moe_intermediate_size > 0,
             "MoE layers need moe_intermediate_size > 0")
        need(self.num_dense_layers == 0 or self.dense_intermediate_size > 0,
             "dense layers need dense_intermediate_size > 0")
        need((self.index_heads > 0) == (self.index_head_dim > 0), "index_heads and index_head_dim go together")

    @classmethod
    def from_model_config(cls, name: str, mc: ModelConfig, weight_bytes: float = 2.0, act_bytes: float = 2.0,
                          expert_weight_bytes: float = 0.0, kv_bytes: float = 2.0,
                          gate_load_cv: float = 0.0) -> "ModelSpec":
        if mc.attention_kind not in ("gqa", "mla", "dsa"):
            raise ValueError(f"ModelSpec {name!r}: attention kind {mc.attention_kind!r} has no cost model")
        f = mc.moe_intermediate_size
        attn = dict(attention="gqa", num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
        if mc.attention_kind != "gqa":
            attn = dict(attention="mla", q_lora_rank=mc.q_lora_rank, kv_lora_rank=mc.kv_lora_rank,
                        qk_nope_head_dim=mc.qk_nope_head_dim, qk_rope_head_dim=mc.qk_rope_head_dim,
                        v_head_dim=mc.v_head_dim, index_heads=mc.index_n_heads, index_head_dim=mc.index_head_dim,
                        index_topk=mc.index_topk)
        return cls(name, num_layers=mc.num_layers, num_dense_layers=mc.num_layers - mc.num_moe_layers,
                   hidden_size=mc.hidden_size, vocab_size=mc.vocab_size, num_heads=mc.num_heads, **attn,
                   num_experts=max(1, mc.num_experts),
                   top_k=max(1, mc.num_experts_per_tok), moe_intermediate_size=f,
                   shared_intermediate_size=mc.shared_expert_intermediate_size,
                   dense_intermediate_size=mc.intermediate_size,
                   weight_bytes=weight_bytes, act_bytes=act_bytes, expert_weight_bytes=expert_weight_bytes,
                   kv_bytes=kv_bytes, gate_load_cv=gate_load_cv)

    @classmethod
    def from_hf_config(cls, name: str, hf: dict, **kw) -> "ModelSpec":
        from moeflow.model.family import family_for, load_families

        load_families()
        return cls.from_model_config(name, family_for(hf).to_model_config(hf), **kw)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_proj_params(self) -> int:
        """Weights of one layer's attention projections (q, k, v or their low-rank factors, o, indexer)."""
        h, n = self.hidden_size, self.num_heads
        if self.attention == "gqa":
            p = h * n * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        else:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
                self.qk_nope_head_dim + self.v_head_dim)
            p = q + kv + n * self.v_head_dim * h
        if self.index_heads:
            src = self.q_lora_rank or h
            p += src * self.index_heads * self.index_head_dim + h * self.index_head_dim + h * self.index_heads
        return p

    @property
    def attn_pair_flops(self) -> int:
        """FLOPs per (query, key) pair of the core attention, all heads: QK^T and PV."""
        if self.attention == "gqa":
            return 4 * self.num_heads * self.head_dim
        if self.index_topk:
            # DSA runs MLA in MQA mode (DeepSeek-V3.2 report: each latent key-value entry is shared by
            # all query heads): scores over the latent + rope dims, values in the latent dim
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    @property
    def attn_pair_flops_mha(self) -> int:
        """FLOPs per (query, key) pair of MLA run as masked multi-head attention (k, v up-projected
        per head; DeepSeek's reference prefill, SGLang below index_topk): QK^T over nope + rope
        dims, PV over v dims. gqa: the same as attn_pair_flops."""
        if self.attention == "gqa":
            return self.attn_pair_flops
        return 2 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    @property
    def tp_replicated_params(self) -> int:
        """Attention weights that vLLM, SGLang and vllm-ascend replicate on every TP rank instead of
        splitting them: MLA's q and kv down-projections (ReplicatedLinear) and the whole DSA
        indexer ("no tensor parallel, just replicated"). 0 for gqa."""
        if self.attention == "gqa":
            return 0
        h = self.hidden_size
        p = h * self.q_lora_rank + h * (self.kv_lora_rank + self.qk_rope_head_dim)
        if self.index_heads:
            src = self.q_lora_rank or h
            p += src * self.index_heads * self.index_head_dim + h * self.index_head_dim + h * self.index_heads
        return p

    @property
    def index_pair_flops(self) -> int:
        """FLOPs per (query, key) pair of the DSA indexer (0 without one); it scores every causal pair."""
        return 2 * self.index_heads * self.index_head_dim

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> float:
        """One routed expert of one layer as served."""
        return self.expert_params * (self.expert_weight_bytes or self.weight_bytes)

    @property
    def attn_kv_bytes_per_token_layer(self) -> float:
        """What attention reads per cached token in one layer: K and V of every KV head (gqa), or the
        latent and its rope key (mla)."""
        if self.attention == "gqa":
            return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """What one cached token costs in one layer: attention's share plus the DSA indexer's key (8
        bits per element, as DeepSeek-V3.2 caches it)."""
        return self.attn_kv_bytes_per_token_layer + self.index_head_dim

    @property
    def attention_side_bytes(self) -> float:
        """Every weight but the routed experts: attention, norms, gates, shared experts, dense MLPs,
        embeddings and LM head. NOTE: quantized checkpoints keep embeddings, LM head, norms and
        gates in bf16 (the FP8 Qwen3 and DeepSeek checkpoints do), so those count 2 bytes."""
        h, moe = self.hidden_size, self.num_moe_layers
        quantized = self.num_layers * self.attn_proj_params + moe * self.shared_params \
            + self.num_dense_layers * self.dense_mlp_params
        bf16 = 2 * self.vocab_size * h + self.num_layers * 2 * h + moe * h * self.num_experts
        return quantized * self.weight_bytes + self.base_bytes * bf16

    def at_dtype(self, dtype: str) -> "ModelSpec":
        """The same model served unquantized in ``dtype`` (what a ``moeflow profile`` of the real engine
        ran): every weight, activation and cached element that wide."""
        width = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}.get(dtype)
        if width is None:
            raise ValueError(f"ModelSpec {self.name!r}: no byte width for dtype {dtype!r}")
        return dataclasses.replace(self, weight_bytes=width, act_bytes=width, expert_weight_bytes=0.0,
                                   kv_bytes=width, base_bytes=width)

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size


# NVFP4 (NVIDIA's 4-bit format): 16 FP4 elements share one FP8 scale, 4.5 bits per weight.
NVFP4_BYTES = 4.5 / 8


# DeepSeek-R1's MoE gate on real traffic, without EPLB: TensorRT-LLM's "Scaling Expert Parallelism"
# blog, Table 1 (decode, machine translation, EP32): per-expert tokens mean 128, std 164.1, CV 1.28.
# Used for DeepSeek-V3.2 too (the same MoE and gate design).
DEEPSEEK_GATE_CV = 1.28
# tiny's own gate: `moeflow bench router-load` (docs/results/sim/router_load_tiny.txt), mean of the
# per-layer CVs 0.66; tiny-mla's gate is not measured and takes tiny's.
TINY_GATE_CV = 0.66


def _derived() -> dict[str, ModelSpec]:
    from moeflow.model.family import FAMILIES, load_families
    from moeflow.model.tiny_config import TINY_HF_CONFIG, TINY_MLA_HF_CONFIG

    load_families()
    mixtral = FAMILIES["MixtralForCausalLM"]

    return {"qwen3-235b-a22b": ModelSpec.from_hf_config("qwen3-235b-a22b", QWEN3_235B_A22B_HF),
            # Served W8A8 on Ascend (CloudMatrix384 paper, §4): int8 weights and int8 dispatch.
            "deepseek-v3.2": ModelSpec.from_hf_config("deepseek-v3.2", DEEPSEEK_V32_HF, weight_bytes=1.0,
                                                      act_bytes=1.0, gate_load_cv=DEEPSEEK_GATE_CV),
            # Qwen/Qwen3-235B-A22B-FP8 (FastAFD's model, §1 and §6): FP8 weights and dispatch, KV in
            # bf16 (vLLM's kv_cache_dtype "auto"; FastAFD's attention runs bf16 FMHA, §1)
            "qwen3-235b-a22b-fp8": ModelSpec.from_hf_config("qwen3-235b-a22b-fp8", QWEN3_235B_A22B_HF,
                                                            weight_bytes=1.0, act_bytes=1.0),
            # DeepSeek-R1 as DWDP serves it (§A4): routed experts in NVFP4, the rest FP8 as DeepSeek
            # released it, FP8 KV cache; tokens dispatched in FP8
            "deepseek-r1": ModelSpec.from_hf_config("deepseek-r1", DEEPSEEK_R1_HF, weight_bytes=1.0, act_bytes=1.0,
                                                    expert_weight_bytes=NVFP4_BYTES, kv_bytes=1.0,
                                                    gate_load_cv=DEEPSEEK_GATE_CV),
            # DeepSeek-V3/R1 as DeepSeek serves it on H800s (its open-infra-index day-6 note; the V3
            # report §3.3: FP8 weights, FP8 dispatch): every weight FP8 as released, KV in bf16 (the
            # note states no KV dtype; FlashMLA as released reads a bf16 cache)
            "deepseek-r1-fp8": ModelSpec.from_hf_config("deepseek-r1-fp8", DEEPSEEK_R1_HF, weight_bytes=1.0,
                                                        act_bytes=1.0, gate_load_cv=DEEPSEEK_GATE_CV),
            # MiniMaxAI/MiniMax-M2.5 (FastAFD §6's second model) as released: FP8 weights, KV in bf16 as
            # Qwen3's above. moeflow's engine has no MiniMax family; its config carries Mixtral's fields
            # (num_local_experts, intermediate_size per expert, every layer MoE, GQA), and what differs
            # (QK norm, partial RoPE, a sigmoid router) costs nothing the simulator prices
            "minimax-m2.5-fp8": ModelSpec.from_model_config("minimax-m2.5-fp8", mixtral.to_model_config(MINIMAX_M2_HF),
                                                            weight_bytes=1.0, act_bytes=1.0),
            # moeflow's embedded models (moeflow/model/tiny_config.py)
            "tiny": ModelSpec.from_hf_config("tiny", TINY_HF_CONFIG, gate_load_cv=TINY_GATE_CV),
            "tiny-mla": ModelSpec.from_hf_config("tiny-mla", TINY_MLA_HF_CONFIG, gate_load_cv=TINY_GATE_CV)}


# Sources: each model's config.json on the Hugging Face Hub; docs/simulator.md lists them with links.
PRESETS: dict[str, ModelSpec] = _derived()


def model_preset(name: str) -> ModelSpec:
    """A preset by name, or the spec of a local Hugging Face checkpoint directory's config.json."""
    if name in PRESETS:
        return PRESETS[name]
    cfg = os.path.join(name, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return ModelSpec.from_hf_config(os.path.basename(os.path.normpath(name)), json.load(f))
    raise ValueError(f"unknown model preset {name!r} (and no config.json there); known: {', '.join(sorted(PRESETS))}")
