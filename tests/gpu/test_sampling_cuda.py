"""Sampling with the model on the GPU: seeds, greedy, top-k / top-p and temperature through
``LLM.generate``, and the sampler's functions on CUDA logits."""
from __future__ import annotations

import math

import pytest
import torch

from cuda_support import DEVICE, GPU, prompts
from moeflow import SamplingParams
from moeflow.model.sampler import logprobs_of, sample_row

pytestmark = GPU

VOCAB = 300  # the qwen3 test checkpoint's
A, B, C = prompts(1, VOCAB, (9, 21, 4))
SAMPLE = dict(max_tokens=16, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints, llm_cache):
    return llm_cache(checkpoints("qwen3").path, device=DEVICE, dtype="float32", num_kv_blocks=128)


def _tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def test_seed_reproducible_alone_and_in_any_batch(llm):
    sp = SamplingParams(seed=7, **SAMPLE)
    alone = _tokens(llm.generate([A], sp)[0])
    assert _tokens(llm.generate([A], sp)[0]) == alone
    others = [SamplingParams(seed=11, **SAMPLE), SamplingParams(**SAMPLE)]
    batch1 = llm.generate([B, A, C], [others[0], sp, others[1]])
    batch2 = llm.generate([A, C, B], [sp, others[1], others[0]])
    assert _tokens(batch1[1]) == alone and _tokens(batch2[0]) == alone
    assert _tokens(batch1[0]) == _tokens(batch2[2])


def test_different_seeds_differ(llm):
    outs = llm.generate([A, A], [SamplingParams(seed=1, **SAMPLE), SamplingParams(seed=2, **SAMPLE)])
    assert _tokens(outs[0]) != _tokens(outs[1])


def test_greedy_is_argmax_and_top_k_1_is_greedy(llm):
    out = llm.generate([B], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5))[0]
    c = out.outputs[0]
    for tok, d in zip(c.token_ids, c.logprobs):
        assert d[tok].rank == 1 and d[tok].logprob == max(lp.logprob for lp in d.values())
    top_k1 = llm.generate([B], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5, ignore_eos=True))[0]
    assert _tokens(top_k1) == c.token_ids


def _next_token_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    d = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=VOCAB))[0].outputs[0].logprobs[0]
    return torch.tensor([d[t].logprob for t in range(VOCAB)])


def _first_tokens(llm, prompt: list[int], n: int, **params) -> list[int]:
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=1, seed=s, **params) for s in range(n)])
    return [o.outputs[0].token_ids[0] for o in outs]


def test_the_whole_vocabulary_sums_to_one(llm):
    assert math.isclose(_next_token_logprobs(llm, C).exp().sum().item(), 1.0, rel_tol=1e-4)


def test_samples_follow_the_tempered_distribution(llm):
    prompt, n, temperature = prompts(2, VOCAB, (4,))[0], 400, 0.5
    lp = _next_token_logprobs(llm, prompt)
    top10 = lp.topk(10).indices.tolist()
    mass = (lp / temperature).softmax(-1)[top10].sum().item()
    sigma = (mass * (1 - mass) / n) ** 0.5
    assert abs(mass - lp.softmax(-1)[top10].sum().item()) > 8 * sigma  # the temperature is visible
    share = sum(t in top10 for t in _first_tokens(llm, prompt, n, temperature=temperature)) / n
    assert abs(share - mass) < 5 * sigma, (share, mass)


def test_top_k_and_top_p_truncate(llm):
    prompt = prompts(2, VOCAB, (4,))[0]
    lp = _next_token_logprobs(llm, prompt)
    assert set(_first_tokens(llm, prompt, 100, temperature=1.0, top_k=5)) <= set(lp.topk(5).indices.tolist())
    probs, order = lp.softmax(-1).sort(descending=True)
    nucleus = set(order[:int((probs.cumsum(-1) < 0.3).sum()) + 1].tolist())
    assert set(_first_tokens(llm, prompt, 100, temperature=1.0, top_p=0.3)) <= nucleus


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
