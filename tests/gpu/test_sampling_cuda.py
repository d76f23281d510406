"""Sampling with the model on the GPU: the CPU suite's sampling tests (tests/unit/test_sampling.py)
run again here against an ``llm`` on CUDA, plus the sampler's functions on CUDA logits.

NOTE: the imported test functions are collected again in this module (pytest collects every
``test*`` function a module holds), where they take this module's ``llm`` fixture and its ``gpu``
mark; their CPU runs in tests/unit are unchanged. Left out: the tests of request validation and
of an interrupted ``generate``, which do not depend on the device.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from cuda_support import DEVICE, GPU
from moeflow.model.sampler import logprobs_of
from moeflow.model.sampler_reference import sample_row

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
from test_sampling import (  # noqa: E402,F401  (collected here, on the GPU)
    test_different_seeds_differ,
    test_logprobs_of_the_whole_vocabulary,
    test_logprobs_per_generated_token,
    test_max_tokens_finishes_with_length,
    test_samples_follow_the_tempered_distribution,
    test_seed_reproducible_alone_and_in_any_batch,
    test_stop_token_ids,
    test_temperature_zero_is_argmax,
    test_top_k_1_and_tiny_top_p_equal_greedy,
    test_top_k_and_top_p_truncate,
)

pytestmark = GPU

VOCAB = 300  # the qwen3 test checkpoint's


@pytest.fixture(scope="module")
def llm(checkpoints, llm_cache):
    return llm_cache(checkpoints("qwen3").path, device=DEVICE, dtype="float32", num_kv_blocks=128)


def test_the_llm_samples_on_the_gpu(llm):
    assert str(llm.config.device).startswith(DEVICE), llm.config.device


def test_sampler_functions_on_cuda_logits():
    """``sample_row`` and ``logprobs_of`` on logits that live on the GPU, with a CUDA generator."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)).to(DEVICE)  # [V]
    assert sample_row(logits, 0.0, -1, 1.0, None) == int(logits.argmax())
    top5 = set(logits.topk(5).indices.tolist())
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    drawn = [sample_row(logits, 1.0, 5, 1.0, gen) for _ in range(50)]
    assert set(drawn) <= top5 and len(set(drawn)) > 1
    again = torch.Generator(device=DEVICE).manual_seed(0)
    assert [sample_row(logits, 1.0, 5, 1.0, again) for _ in range(50)] == drawn
    rows = torch.stack([logits, -logits])  # [2, V]
    chosen = torch.tensor([int(logits.argmax()), 0], device=DEVICE)
    lp = logprobs_of(rows, chosen, 3)
    assert lp[0][int(logits.argmax())][1] == 1 and len(lp[0]) == 3
    ref = rows.float().log_softmax(-1).cpu()
    assert all(math.isclose(v, ref[b, t].item(), abs_tol=1e-5) for b in range(2) for t, (v, _) in lp[b].items())
