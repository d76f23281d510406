"""The grouped experts op on the GPU (``F.grouped_mm``'s CUDA kernels: bf16, compute capability 9.0
and newer) against its loop oracle: the unit suite's small shapes, the embedded model's real ones,
DWDP's several stacks, and a whole model run with either op."""
from __future__ import annotations

import pytest
import torch

from cuda_support import DEVICE, GPU, prompts
from moeflow.model.kv_cache import AttentionMetadata
from moeflow.model.moe import ExpertWeights, experts_grouped, experts_list, experts_loop, experts_merged
from moeflow.model.transformer import MoETransformer
from moeflow.model.weights import load_weights

pytestmark = GPU

LAYER_IDS = (0, 2, 3)
COUNTS = [
    [3, 0, 5, 1, 0, 0, 7, 2],  # some experts get no tokens
    [0, 0, 0, 0, 0, 0, 0, 9],  # everything to the last expert
    [0, 0, 0, 0, 0, 0, 0, 0],  # empty batch
    [1, 1, 1, 1, 1, 1, 1, 1],
]


def _weights(e: int, h: int, f: int, dtype, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    scale = h ** -0.5  # keeps |y| ~ 1 at any width
    w13 = torch.randn(len(LAYER_IDS), e, 2 * f, h, generator=g) * scale  # [Lm, E, 2F, H]
    w2 = torch.randn(len(LAYER_IDS), e, h, f, generator=g) * f ** -0.5  # [Lm, E, H, F]
    return ExpertWeights(w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), LAYER_IDS, tuple(range(e)))


def _rows(counts: list[int], h: int, dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(sum(counts), h, generator=torch.Generator().manual_seed(seed))  # [N, H]
    return x.to(DEVICE, dtype), torch.tensor(counts, device=DEVICE)


def _fp32(w: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(w.w13.float(), w.w2.float(), w.layer_ids, w.expert_ids)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("layer", LAYER_IDS)
def test_grouped_matches_loop_fp32(layer, counts):
    w = _weights(8, 32, 16, torch.float32)
    x, c = _rows(counts, 32, torch.float32, seed=layer)
    got = experts_grouped(w, layer, x, c)
    assert got.device.type == torch.device(DEVICE).type and got.shape == (sum(counts), 32)
    # NOTE: on CUDA grouped_mm takes bf16 only (on compute capability 9.0+), so float32 runs the
    # loop: this holds the dispatch to it. 1e-4, not the CPU suite's 1e-5: cuBLAS may sum in another order
    torch.testing.assert_close(got, experts_loop(w, layer, x, c), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_matches_loop_bf16(counts):
    w = _weights(8, 64, 32, torch.bfloat16)
    x, c = _rows(counts, 64, torch.bfloat16, seed=9)
    for layer in LAYER_IDS:
        got = experts_grouped(w, layer, x, c)
        assert got.dtype == torch.bfloat16
        # the same bf16 inputs in fp32 arithmetic: only bf16 rounding of the GEMM outputs and the
        # activation separates them
        ref = experts_loop(_fp32(w), layer, x.float(), c)
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_grouped_matches_loop_at_the_embedded_models_shape(tokens):
    """hidden 1024, 16 experts of width 640, top-4 (tiny's), in bf16: the shapes the CUDA kernel sees in a run."""
    g = torch.Generator().manual_seed(tokens)
    pairs = torch.randint(0, 16, (tokens * 4,), generator=g)
    counts = torch.bincount(pairs, minlength=16).tolist()
    w = _weights(16, 1024, 640, torch.bfloat16, seed=1)
    x, c = _rows(counts, 1024, torch.bfloat16, seed=2)
    got = experts_grouped(w, 2, x, c)
    ref = experts_loop(_fp32(w), 2, x.float(), c)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)


def test_several_stacks_equal_one_merged_stack():
    """DWDP's resident + pulled experts, run stack by stack, equal the copy into one buffer."""
    w = _weights(8, 64, 32, torch.bfloat16)
    parts = [(w.w13[1, :3], w.w2[1, :3]), (w.w13[1, 3:], w.w2[1, 3:])]  # [3 | 5 experts]
    x, c = _rows(COUNTS[0], 64, torch.bfloat16, seed=4)
    got = experts_list(parts, x, c)
    torch.testing.assert_close(got, experts_merged(parts, x, c), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), experts_loop(_fp32(w), 2, x.float(), c), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe"])
@torch.no_grad()
def test_a_model_with_grouped_experts_equals_one_with_the_loop(checkpoints, name):
    cfg, w = load_weights(checkpoints(name).path, torch.float32, device=DEVICE)
    seq = prompts(7, cfg.vocab_size, (40,))[0]
    meta = AttentionMetadata.no_cache([len(seq)], device=DEVICE)
    ids = torch.tensor(seq, device=DEVICE)
    out = [MoETransformer(cfg, w, use_grouped_experts=g).forward(ids, meta, None) for g in (True, False)]
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)
