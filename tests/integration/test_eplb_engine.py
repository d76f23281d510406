"""Redundant experts (``num_redundant_experts``) in every mode that spreads experts, against the
colocated reference: real worker processes; a replicated expert's tokens go to one copy each."""
from __future__ import annotations

import pytest

from moeflow import LLM

from parity import PARAMS, PROMPTS, assert_same, colocated_outputs


@pytest.fixture(scope="module")
def reference(checkpoints):
    return colocated_outputs(checkpoints, ("qwen3", "deepseek_v3"))


@pytest.mark.parametrize("name,layout", [
    ("qwen3", dict(mode="dep", dp=3, num_redundant_experts=2)),  # 10 slots over 3 ranks: 3/3/4
    ("qwen3", dict(mode="asap", attn_dp=2, moe_workers=2, num_redundant_experts=3, min_batch_tokens=8,
                   max_batch_tokens=128)),
    ("deepseek_v3", dict(mode="afd", attn_workers=2, ffn_workers=2, topology="all", num_redundant_experts=2)),
    ("qwen3", dict(mode="afd", attn_workers=1, ffn_workers=3, topology="all", router="ffn", num_redundant_experts=4)),
])
def test_redundant_experts_match_colocated(checkpoints, reference, name, layout):
    with LLM(checkpoints(name).path, dtype="float32", **layout) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    assert_same(outs, reference[name])


def test_bad_redundancy_is_refused_naming_the_numbers(checkpoints):
    path = checkpoints("qwen3").path
    with pytest.raises(ValueError, match="num_redundant_experts must be an int >= 0, got -2"):
        LLM(path, mode="dep", dp=2, num_redundant_experts=-2)
    with pytest.raises(ValueError, match="num_redundant_experts=1 needs topology 'all'"):
        LLM(path, mode="afd", attn_workers=2, ffn_workers=2, num_redundant_experts=1)
    with pytest.raises(ValueError, match=r"num_redundant_experts \(9\) is more than the model's 8 experts"):
        LLM(path, mode="dep", dp=2, num_redundant_experts=9)


def test_the_engine_counts_every_routed_token(checkpoints):
    """Each MoE layer routes every token a step feeds (prompts, then one per decode step), K pairs each."""
    path = checkpoints("qwen3").path
    with LLM(path, dtype="float32", mode="asap", attn_dp=2, attn_tp=2, moe_workers=2, num_redundant_experts=2) as llm:
        llm.generate(PROMPTS, PARAMS)
        x = llm.engine.expert_load
        load = llm.engine.load()
        cfg = llm.engine.model_config
    fed = sum(len(p) for p in PROMPTS) + (PARAMS.max_tokens - 1) * len(PROMPTS)
    assert x.total.sum(axis=1).tolist() == [fed * cfg.num_experts_per_tok] * cfg.num_moe_layers
    assert load.eplb_physical_experts == cfg.num_experts + 2
    assert [layer for layer, _ in load.eplb_balancedness] == [l for l in range(cfg.num_layers) if cfg.sparse_layers[l]]
    assert all(0 < b <= 1 for _, b in load.eplb_balancedness)
