"""Architecture registry: what differs between MoE families is a config translation (which also
names the attention and gate kinds) and checkpoint key names.

Adding an architecture = one small file that builds a ``Family`` and calls ``register``. This file
and the family files import no torch: the simulator reads models through them too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moeflow.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Family:
    architecture: str  # Hugging Face class name in config.json "architectures"
    to_model_config: Callable[[dict], ModelConfig]
    moe_prefix: str  # module of the MoE block inside a layer: "mlp" or "block_sparse_moe"
    expert_proj: tuple[str, str, str]  # names of the (gate, up, down) projections of one expert
    # module of the attention inside a layer; the attention kind names the tensors inside it
    attention_module: str = "self_attn"
    embed_key: str = "model.embed_tokens.weight"
    final_norm_key: str = "model.norm.weight"
    lm_head_key: str = "lm_head.weight"
    shared_expert_module: str = "shared_expert"  # Qwen2-MoE's; DeepSeek's is "shared_experts"
    gate_bias: str | None = None  # the gate's selection bias tensor under it ("e_score_correction_bias")

    def layer(self, i: int) -> str:
        return f"model.layers.{i}."

    def attention_prefix(self, layer: int) -> str:
        return f"{self.layer(layer)}{self.attention_module}."

    def input_norm_key(self, layer: int) -> str:
        return f"{self.layer(layer)}input_layernorm.weight"

    def post_norm_key(self, layer: int) -> str:
        return f"{self.layer(layer)}post_attention_layernorm.weight"

    def expert_key(self, layer: int, expert: int, which: int) -> str:
        return f"{self.layer(layer)}{self.moe_prefix}.experts.{expert}.{self.expert_proj[which]}.weight"

    def gate_key(self, layer: int) -> str:
        return f"{self.layer(layer)}{self.moe_prefix}.gate.weight"

    def gate_bias_key(self, layer: int) -> str | None:
        return None if self.gate_bias is None else f"{self.layer(layer)}{self.moe_prefix}.gate.{self.gate_bias}"

    def shared_expert_key(self, layer: int, proj: str) -> str:
        return f"{self.layer(layer)}{self.moe_prefix}.{self.shared_expert_module}.{proj}.weight"

    def shared_gate_key(self, layer: int) -> str:
        return f"{self.layer(layer)}{self.moe_prefix}.shared_expert_gate.weight"

    def dense_key(self, layer: int, proj: str) -> str:
        return f"{self.layer(layer)}mlp.{proj}.weight"


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.architecture] = family
    return family


def family_for(hf_config: dict) -> Family:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ConfigError(f"unsupported architecture {archs or hf_config.get('model_type')!r}; "
                      f"moeflow supports {sorted(FAMILIES)}")


ROPE_TYPES = ("default", "yarn")  # model/rope.py implements these
_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def rope_config(hf: dict) -> tuple[float, tuple[tuple[str, object], ...]]:
    """(rope_theta, scaling) from a v4 (``rope_theta`` + ``rope_scaling``) or v5 (``rope_parameters``) config."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json has no rope_theta")
    if rope_type == "default":
        return float(theta), ()
    if params.get("original_max_position_embeddings") is None:
        raise ConfigError("yarn RoPE needs original_max_position_embeddings in rope_parameters")
    scaling = {"rope_type": rope_type, **{k: params[k] for k in _ROPE_KEYS if params.get(k) is not None}}
    return float(theta), tuple(sorted(scaling.items()))


def get(hf: dict, *names: str, default=None):
    """First present key among ``names`` (configs renamed fields across transformers versions)."""
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    if default is not None:
        return default
    raise ConfigError(f"config.json lacks {' / '.join(names)}")


def eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def common_fields(hf: dict) -> dict:
    """Fields every supported family spells the same way."""
    h, heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    return dict(
        vocab_size=get(hf, "vocab_size"),
        hidden_size=h,
        num_layers=get(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=get(hf, "num_key_value_heads", default=heads),
        head_dim=get(hf, "head_dim", default=h // heads),
        rope_theta=rope_config(hf)[0],
        rope_scaling=rope_config(hf)[1],
        rms_norm_eps=float(get(hf, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=get(hf, "max_position_embeddings", default=32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
        checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        extra={"model_type": hf.get("model_type")},
    )


def qwen_sparse_layers(hf: dict) -> tuple[bool, ...]:
    """Qwen-style placement: MoE where (i+1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    n = get(hf, "num_hidden_layers")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    num_experts = get(hf, "num_experts", "num_local_experts", default=0)
    return tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))


def load_families() -> None:
    """Import the family files so they register (kept explicit: no import side effects elsewhere)."""
    from moeflow.model import deepseek_v3, mixtral, qwen2_moe, qwen3_moe  # noqa: F401
