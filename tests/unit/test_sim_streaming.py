"""The memory-bound rates of the simulator's two streaming kernels on NVIDIA presets: decode
attention reads the KV cache at FlashMLA's published share of HBM bandwidth, every other streaming
op (the experts' grouped GEMM) at FBGEMM's; a preset without its own attention figure streams the KV
cache at its general rate."""
from __future__ import annotations

import pytest

from moeflow.sim.attention_cost import attention_parts
from moeflow.sim.cost import AnalyticCost
from moeflow.sim.hardware import PRESETS, Hardware
from moeflow.sim.model_spec import model_preset
from moeflow.sim.shape import AttnShape


def _decode_core_s(hw: Hardware, batch: int = 64, context: int = 8192) -> tuple[float, float]:
    c = AnalyticCost(model_preset("qwen3-235b-a22b-fp8"), hw)
    shape = AttnShape.of([(context, 1, True)] * batch)
    kv = shape.num_keys * c.model.attn_kv_bytes_per_token_layer
    return attention_parts(c, shape, 1, False)["core"], kv


@pytest.mark.parametrize("name", ["h100", "h800", "h200", "gb200"])
def test_nvidia_decode_attention_streams_the_kv_cache_at_flashmla_rate(name):
    hw = PRESETS[name]
    core, kv = _decode_core_s(hw)
    assert hw.attn_mem_eff == pytest.approx(3000 / 3350)
    assert core == pytest.approx(hw.launch_s + kv / (hw.mem_bw_Bps * hw.attn_mem_eff))


def test_a_preset_without_its_own_attention_rate_uses_the_general_one():
    hw = PRESETS["ascend-910c-die"]
    assert hw.attn_mem_eff == 0
    core, kv = _decode_core_s(hw, batch=8)
    assert core == pytest.approx(hw.launch_s + kv / (hw.mem_bw_Bps * hw.mem_eff))


def test_nvidia_experts_stream_their_weights_at_fbgemm_rate():
    hw = PRESETS["gb200"]
    c = AnalyticCost(model_preset("qwen3-235b-a22b-fp8"), hw)
    m = c.model
    assert hw.mem_eff == pytest.approx(3705 / 4800)
    # 32 local experts, a few hundred pairs: every expert is read once, the op is memory-bound
    pairs, local = 576, 32
    active = local * (1 - (1 - 1 / local) ** pairs)
    nbytes = active * m.expert_bytes + pairs * m.hidden_size * (m.act_bytes + 2)
    assert c.experts_s(pairs, local) == pytest.approx(hw.launch_s + nbytes / (hw.mem_bw_Bps * hw.mem_eff))


def test_attn_mem_eff_is_validated():
    with pytest.raises(ValueError, match="attn_mem_eff must be in"):
        PRESETS["gb200"].with_overrides(attn_mem_eff=1.5)
