"""The grouped experts op against its loop oracle, expert subsets, and the router."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.config import ModelConfig
from moeflow.model.moe import ExpertWeights, experts_grouped, experts_loop, plan_pairs, weighted_sum
from moeflow.model.gate import route
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import ModelWeights

torch.set_num_threads(1)

H, FF, E, K = 32, 16, 8, 2  # hidden, expert intermediate, experts, experts per token
LAYER_IDS = (0, 2, 3)  # MoE layers held (layer 1 is dense): slots 0, 1, 2


def _weights(expert_ids=tuple(range(E)), dtype=torch.float32, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(len(LAYER_IDS), E, 2 * FF, H, generator=g) * 0.2  # [Lm, E, 2F, H]
    w2 = torch.randn(len(LAYER_IDS), E, H, FF, generator=g) * 0.2  # [Lm, E, H, F]
    idx = list(expert_ids)
    return ExpertWeights(w13[:, idx].to(dtype), w2[:, idx].to(dtype), LAYER_IDS, tuple(expert_ids))


def _manual(w: ExpertWeights, slot: int, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert written out independently of both ops: down(silu(gate x) * up x)."""
    g, u = w.w13[slot, e, :FF].float(), w.w13[slot, e, FF:].float()
    return (F.silu(x.float() @ g.T) * (x.float() @ u.T)) @ w.w2[slot, e].float().T


COUNTS = [
    [3, 0, 5, 1, 0, 0, 7, 2],  # some experts get no tokens
    [0, 0, 0, 0, 0, 0, 0, 9],  # everything to the last expert
    [0, 0, 0, 0, 0, 0, 0, 0],  # empty batch
    [1, 1, 1, 1, 1, 1, 1, 1],
]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("layer", LAYER_IDS)
def test_grouped_matches_loop_fp32(layer, counts):
    w = _weights()
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(layer))  # [N, H]
    got = experts_grouped(w, layer, x, counts)
    ref = experts_loop(w, layer, x, counts)
    assert got.shape == ref.shape == (int(counts.sum()), H)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_matches_loop_bf16(counts):
    w32 = _weights()
    w16 = ExpertWeights(w32.w13.bfloat16(), w32.w2.bfloat16(), w32.layer_ids, w32.expert_ids)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(9))
    for layer in LAYER_IDS:
        got = experts_grouped(w16, layer, x.bfloat16(), counts)
        assert got.dtype == torch.bfloat16
        # against the same bf16 inputs in fp32 arithmetic: only bf16 rounding of the two GEMM
        # outputs and the activation separates them (|y| ~ 1 here, bf16 eps 2^-8)
        ref = experts_loop(ExpertWeights(w16.w13.float(), w16.w2.float(), LAYER_IDS, w16.expert_ids),
                           layer, x.bfloat16().float(), counts)
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(got, experts_loop(w16, layer, x.bfloat16(), counts), atol=3e-2, rtol=2e-2)


def test_layer_is_a_runtime_argument():
    """One ExpertWeights object; the layer id picks the stacked slot."""
    w = _weights()
    counts = torch.tensor([2, 1, 0, 3, 0, 1, 0, 1])
    x = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(1))
    experts_of_row = torch.repeat_interleave(torch.arange(E), counts)  # [N]
    outs = {}
    for slot, layer in enumerate(LAYER_IDS):
        outs[layer] = experts_grouped(w, layer, x, counts)
        expect = torch.stack([_manual(w, slot, int(e), x[i:i + 1])[0] for i, e in enumerate(experts_of_row)])
        torch.testing.assert_close(outs[layer], expect, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs[0], outs[2]) and not torch.allclose(outs[2], outs[3])
    with pytest.raises(KeyError, match="layer 1"):  # a dense layer: not held
        experts_grouped(w, 1, x, counts)


def test_plan_pairs_puts_the_pairs_of_experts_not_held_last_and_masks_them():
    held = (1, 4, 6)
    w = _weights(held)
    topk_ids = torch.tensor([[1, 6], [0, 2], [6, 4], [7, 1], [3, 5]])  # [T, K] global ids
    plan = plan_pairs(topk_ids, w)
    # grouped by local expert (1 -> 0, 4 -> 1, 6 -> 2), stable within a group; then the others,
    # in order: a row per pair whatever the data (no nonzero, no host sync), the rest not computed
    assert plan.counts.tolist() == [2, 1, 2]
    assert plan.pair_index.tolist() == [0, 7, 5, 1, 4, 2, 3, 6, 8, 9]  # flat t*K + k
    assert plan.token_index.tolist() == [0, 3, 2, 0, 2, 1, 1, 3, 4, 4]
    assert plan.held.tolist() == [True] * 5 + [False] * 5
    local = w.local_ids(topk_ids.reshape(-1))
    assert local.tolist() == [0, 2, -1, -1, 2, 1, -1, 0, -1, -1]
    # ids above the largest held one map to -1 too (no out-of-range lookup)
    assert w.local_ids(torch.tensor([7, 100])).tolist() == [-1, -1]


def _transformer(w: ExpertWeights) -> MoETransformer:
    cfg = ModelConfig(architecture="test", vocab_size=16, hidden_size=H, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=64, num_experts=E, num_experts_per_tok=K,
                      moe_intermediate_size=FF, norm_topk_prob=True,
                      sparse_layers=(True, False, True, True), intermediate_size=24)
    return MoETransformer(cfg, ModelWeights(experts=w))


@pytest.mark.parametrize("grouped", [True, False])
def test_expert_subsets_sum_to_the_full_layer(grouped):
    """Disjoint expert subsets (as on MoE workers) add up to the full result; tokens with no local
    expert get exact zeros."""
    t = 10
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, H, generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])  # [T, K] distinct
    topk_ids[0] = torch.tensor([0, 2])  # token 0 only uses experts outside the subset (1, 4, 6)
    topk_w = torch.rand(t, K, generator=g)
    subsets = [(1, 4, 6), (0, 2, 3, 5, 7)]
    for layer in LAYER_IDS:
        full = _transformer(_weights()).experts(layer, x, topk_ids, topk_w)
        slot = LAYER_IDS.index(layer)
        ref = torch.stack([sum(topk_w[i, j] * _manual(_weights(), slot, int(topk_ids[i, j]), x[i:i + 1])[0]
                               for j in range(K)) for i in range(t)])
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
        parts = [MoETransformer(m.cfg, m.w, use_grouped_experts=grouped).experts(layer, x, topk_ids, topk_w)
                 for m in (_transformer(_weights(s)) for s in subsets)]
        assert torch.equal(parts[0][0], torch.zeros(H))
        torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)


def test_weighted_sum_accumulates_into_out():
    w = _weights()
    topk_ids = torch.tensor([[0, 1], [1, 2]])
    plan = plan_pairs(topk_ids, w)
    y = torch.ones(int(plan.counts.sum()), H)
    out = torch.full((2, H), 10.0)
    res = weighted_sum(2, plan, y, torch.tensor([[0.25, 0.5], [1.0, 2.0]]), out=out)
    assert res is out
    assert res[:, 0].tolist() == [10.75, 13.0]


@pytest.mark.parametrize("norm", [True, False])
def test_route(norm):
    g = torch.Generator().manual_seed(0)
    x, gate_w = torch.randn(12, H, generator=g), 0.1 * torch.randn(E, H, generator=g)  # soft routing
    ids, wts = route(x, gate_w, 3, norm)
    assert ids.shape == wts.shape == (12, 3) and ids.dtype == torch.int64 and wts.dtype == torch.float32
    probs = (x @ gate_w.T).softmax(-1)
    ref_w, ref_ids = probs.topk(3, dim=-1)
    assert torch.equal(ids, ref_ids)
    if norm:
        torch.testing.assert_close(wts.sum(-1), torch.ones(12))
        torch.testing.assert_close(wts, ref_w / ref_w.sum(-1, keepdim=True))
    else:
        torch.testing.assert_close(wts, ref_w)
        assert bool((wts.sum(-1) < 1).all())
    # bf16 activations still route in float32
    ids16, wts16 = route(x.bfloat16(), gate_w.bfloat16(), 3, norm)
    assert wts16.dtype == torch.float32 and ids16.shape == (12, 3)


def test_bf16_unaligned_shapes_fall_back_to_the_loop():
    # grouped_mm needs 16-byte row strides; H=20 in bf16 is 40 bytes, so the op must not fail
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights((torch.randn(1, 4, 2 * 6, 20, generator=g) * 0.2).bfloat16(),
                      (torch.randn(1, 4, 20, 6, generator=g) * 0.2).bfloat16(), (0,), (0, 1, 2, 3))
    x = torch.randn(7, 20, generator=g).bfloat16()
    counts = torch.tensor([2, 0, 4, 1])
    assert torch.equal(experts_grouped(w, 0, x, counts), experts_loop(w, 0, x, counts))
