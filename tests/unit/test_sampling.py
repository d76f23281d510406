"""Sampling semantics through ``LLM.generate``: seeds, greedy, top-k, logprobs, stop conditions."""
from __future__ import annotations

import math

import pytest
import torch

from moeflow import SamplingParams
from moeflow.core import RequestError


@pytest.fixture(scope="module")
def llm(checkpoints, llm_cache):
    return llm_cache(checkpoints("qwen3").path, dtype="float32", num_kv_blocks=128)


def _prompt(seed: int, n: int, vocab_size: int = 300) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B, C = _prompt(1, 9), _prompt(2, 21), _prompt(3, 4)
SAMPLE = dict(max_tokens=16, temperature=1.0, ignore_eos=True)


def _tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def test_seed_reproducible_alone_and_in_any_batch(llm):
    sp = SamplingParams(seed=7, **SAMPLE)
    alone = _tokens(llm.generate([A], sp)[0])
    assert _tokens(llm.generate([A], sp)[0]) == alone
    others = [SamplingParams(seed=11, **SAMPLE), SamplingParams(**SAMPLE)]  # seeded and unseeded neighbours
    batch1 = llm.generate([B, A, C], [others[0], sp, others[1]])
    batch2 = llm.generate([A, C, B], [sp, others[1], others[0]])
    assert _tokens(batch1[1]) == alone
    assert _tokens(batch2[0]) == alone
    assert _tokens(batch1[0]) == _tokens(batch2[2])  # B with seed 11, at different batch positions


def test_different_seeds_differ(llm):
    outs = llm.generate([A, A], [SamplingParams(seed=1, **SAMPLE), SamplingParams(seed=2, **SAMPLE)])
    assert _tokens(outs[0]) != _tokens(outs[1])


@pytest.mark.parametrize("temperature", [0, 1e-6, 5e-324])  # 1/T of the last two overflows float32
def test_temperature_zero_is_argmax(llm, temperature):
    out = llm.generate([B], SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True, logprobs=5))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 12
    for tok, d in zip(c.token_ids, c.logprobs):
        assert d[tok].rank == 1
        assert d[tok].logprob == max(lp.logprob for lp in d.values())


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = _tokens(llm.generate([B], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0])
    top_k1 = llm.generate([B], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5, ignore_eos=True))[0]
    assert _tokens(top_k1) == greedy
    for top_p in (1e-6, 5e-324):  # the second is 0 in float32
        top_p0 = llm.generate([B], SamplingParams(max_tokens=12, temperature=1.5, top_p=top_p, seed=5,
                                                  ignore_eos=True))[0]
        assert _tokens(top_p0) == greedy


def _next_token_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """[V] the model's raw next-token log-distribution after ``prompt``."""
    d = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=300))[0].outputs[0].logprobs[0]
    return torch.tensor([d[t].logprob for t in range(300)])


def _first_tokens(llm, prompt: list[int], n: int, **params) -> list[int]:
    """The first sampled token of ``n`` requests with seeds 0..n-1 (one generate call)."""
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=1, seed=s, **params) for s in range(n)])
    return [o.outputs[0].token_ids[0] for o in outs]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_samples_follow_the_tempered_distribution(llm, temperature):
    prompt, n = _prompt(2, 4), 400
    lp = _next_token_logprobs(llm, prompt)
    top10 = set(lp.topk(10).indices.tolist())
    mass = (lp / temperature).softmax(-1)[list(top10)].sum().item()  # expected share of the top-10
    sigma = (mass * (1 - mass) / n) ** 0.5
    untempered = lp.softmax(-1)[list(top10)].sum().item()
    assert abs(mass - untempered) > 8 * sigma  # the test can tell the temperature was applied
    share = sum(t in top10 for t in _first_tokens(llm, prompt, n, temperature=temperature)) / n
    assert abs(share - mass) < 5 * sigma, (share, mass, untempered)


def test_top_k_and_top_p_truncate(llm):
    prompt = _prompt(2, 4)
    lp = _next_token_logprobs(llm, prompt)
    top5 = set(lp.topk(5).indices.tolist())
    assert set(_first_tokens(llm, prompt, 100, temperature=1.0, top_k=5)) <= top5
    probs, order = lp.softmax(-1).sort(descending=True)
    nucleus = set(order[:int((probs.cumsum(-1) < 0.3).sum()) + 1].tolist())  # smallest set with mass >= 0.3
    assert 1 < len(nucleus) < 300
    assert set(_first_tokens(llm, prompt, 100, temperature=1.0, top_p=0.3)) <= nucleus


@pytest.mark.parametrize("n", [0, 1, 4])
def test_logprobs_per_generated_token(llm, n):
    out = llm.generate([A], SamplingParams(logprobs=n, seed=3, **SAMPLE))[0]
    c = out.outputs[0]
    assert out.prompt_logprobs is None  # not requested
    assert len(c.logprobs) == len(c.token_ids) == SAMPLE["max_tokens"]
    total = 0.0
    for tok, d in zip(c.token_ids, c.logprobs):
        assert tok in d
        assert n <= len(d) <= n + 1
        top = sorted((t for t in d if d[t].rank <= n), key=lambda t: d[t].rank)
        assert [d[t].rank for t in top] == list(range(1, n + 1))
        assert all(lp.logprob <= 0.0 for lp in d.values())
        total += d[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6, abs_tol=1e-6)


def test_logprobs_of_the_whole_vocabulary(llm):
    out = llm.generate([C], SamplingParams(max_tokens=2, temperature=0, logprobs=300, prompt_logprobs=300))[0]
    for d in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert sorted(lp.rank for lp in d.values()) == list(range(1, 301))
        assert math.isclose(sum(math.exp(lp.logprob) for lp in d.values()), 1.0, rel_tol=1e-4)


def test_no_logprobs_by_default(llm):
    c = llm.generate([A], SamplingParams(seed=3, **SAMPLE))[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -1.0),
    ("top_k", -2), ("top_k", 1.5),
    ("logprobs", -1), ("prompt_logprobs", -1), ("seed", "x"), ("seed", 2**64), ("seed", -2**63 - 1),
])
def test_sampling_params_validation(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_stop_token_ids(llm):
    greedy = _tokens(llm.generate([C], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0])
    # the first token (from the 3rd on) that was not produced earlier: stopping on it ends right there
    j = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    stop = greedy[j]
    out = llm.generate([C], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop]))[0]
    c = out.outputs[0]
    assert c.token_ids == greedy[:j + 1]  # the stop token is part of the output, as in vLLM
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert out.finished


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate([C], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 5
    assert c.finish_reason == "length" and c.stop_reason is None
    assert out.finished


def test_bad_prompts_raise_request_error(llm):
    with pytest.raises(RequestError, match="300"):  # names the vocabulary bound
        llm.generate([A, [1, 2, 300]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="empty"):
        llm.generate([B, []], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="logprobs=301 exceeds the vocabulary size 300"):
        llm.generate([A], SamplingParams(max_tokens=2, logprobs=301))
    with pytest.raises(RequestError, match="prompt_logprobs=301 exceeds the vocabulary size 300"):
        llm.generate([A], SamplingParams(max_tokens=2, prompt_logprobs=301))
    # the valid prompts queued before the bad one were withdrawn: the engine is idle and usable
    assert not llm.engine.has_unfinished()
    assert len(_tokens(llm.generate([A], SamplingParams(max_tokens=2, temperature=0))[0])) == 2


def test_generate_interrupted_leaves_nothing_queued(monkeypatch, llm):
    """An exception inside a step aborts this call's requests; the engine stays usable."""
    engine = llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=0))
    monkeypatch.setattr(engine, "step", real_step)
    assert not engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
