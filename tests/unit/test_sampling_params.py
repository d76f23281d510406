"""The sampling parameters beyond temperature/top-k/top-p, through ``LLM.generate``: penalties
(against transformers' generate, and the oracle on the raw logprobs), logit_bias, min_p,
min_tokens (with EOS and with stop tokens), stop strings, and n > 1 sharing its prefill."""
from __future__ import annotations

import pytest
import torch

from moeflow import SamplingParams
from moeflow.core import RequestError
from moeflow.model.sampler import RowSampling
from moeflow.model.sampler_reference import reference_probabilities

V = 300
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints, llm_cache):
    return llm_cache(checkpoints("qwen3").path, dtype="float32", num_kv_blocks=128)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P = _prompt(5, 11)


def _one(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_equals_transformers_generate(checkpoints, llm, penalty):
    model = checkpoints("qwen3").model
    ids = torch.tensor([P])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                             min_new_tokens=24, repetition_penalty=penalty, pad_token_id=0)[0, len(P):].tolist()
    ours = _one(llm, P, max_tokens=24, repetition_penalty=penalty, **GREEDY).token_ids
    plain = _one(llm, P, max_tokens=24, **GREEDY).token_ids
    assert ours == ref
    assert ours != plain  # the penalty changed something


def test_presence_and_frequency_penalties_step_by_step_on_the_raw_logprobs(llm):
    """Each greedy token is the argmax of the oracle applied to that step's raw distribution
    (penalties shift logits, so the raw logprobs, a constant away from the logits, suffice)."""
    row = RowSampling(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.8)
    c = _one(llm, P, max_tokens=20, presence_penalty=1.5, frequency_penalty=0.8, logprobs=V, **GREEDY)
    for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
        raw = torch.tensor([d[t].logprob for t in range(V)])
        want = int(reference_probabilities(raw, row, P, c.token_ids[:i]).argmax())
        assert tok == want, f"step {i}"
    assert len(set(c.token_ids)) > len(set(_one(llm, P, max_tokens=20, **GREEDY).token_ids))


def test_logit_bias_forces_and_forbids(llm):
    keep = 42
    only = tuple((t, -100.0) for t in range(V) if t != keep)
    assert _one(llm, P, max_tokens=6, logit_bias=only, **GREEDY).token_ids == [keep] * 6
    sampled = _one(llm, P, max_tokens=6, logit_bias=only, temperature=1.0, seed=1, ignore_eos=True).token_ids
    assert sampled == [keep] * 6
    greedy = _one(llm, P, max_tokens=6, **GREEDY).token_ids
    banned = _one(llm, P, max_tokens=6, logit_bias={greedy[0]: -100.0}, **GREEDY).token_ids
    assert banned[0] != greedy[0]
    with pytest.raises(RequestError, match="logit_bias names token id 300"):
        llm.generate([P], SamplingParams(logit_bias={300: 1.0}))


def test_min_p_keeps_only_tokens_near_the_top(llm):
    lp = _one(llm, P, max_tokens=1, logprobs=V, temperature=0.0).logprobs[0]
    probs = torch.tensor([lp[t].logprob for t in range(V)]).exp()
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    outs = llm.generate([P] * 60, [SamplingParams(max_tokens=1, min_p=0.3, seed=s) for s in range(60)])
    assert {o.outputs[0].token_ids[0] for o in outs} <= allowed


def test_min_tokens_holds_back_eos_and_stop_tokens(checkpoints, llm_cache, llm):
    tiny = llm_cache("tiny", dtype="float32", num_kv_blocks=64)
    eos = 257  # the embedded model's <eos>, which a bias of +100 makes the greedy choice
    eager = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    assert tiny.generate(["Hi"], eager)[0].outputs[0].token_ids == [eos]
    c = tiny.generate(["Hi"], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0},
                                             min_tokens=5))[0].outputs[0]
    assert len(c.token_ids) == 6 and eos not in c.token_ids[:5] and c.token_ids[5] == eos
    assert c.finish_reason == "stop"
    stop = 7
    c = _one(llm, P, max_tokens=20, logit_bias={stop: 100.0}, stop_token_ids=[stop], min_tokens=3, **GREEDY)
    assert len(c.token_ids) == 4 and c.token_ids[3] == stop and c.stop_reason == stop


def _text(llm, c) -> str:
    return llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_stop_strings_cut_the_text(llm):
    prompt = list(b"The quick brown fox ")
    full = _one(llm, prompt, max_tokens=40, **GREEDY)
    text = _text(llm, full)
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i + 1])
    stop = text[start:start + 2]
    c = _one(llm, prompt, max_tokens=40, stop=[stop, "never appears \u2603"], **GREEDY)
    assert c.text == text[:start] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full.token_ids[:len(c.token_ids)] and len(c.token_ids) < 40
    c = _one(llm, prompt, max_tokens=40, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert c.text == text[:start + 2]
    # not before min_tokens: the same string, only allowed from token 30 on
    late = _one(llm, prompt, max_tokens=40, stop=[stop], min_tokens=len(c.token_ids) + 1, **GREEDY)
    assert len(late.token_ids) > len(c.token_ids)
    assert late.text.startswith(text[:start + 2])  # the same greedy tokens, past the early stop


def test_n_samples_equal_single_requests_with_consecutive_seeds(llm):
    prompt = _prompt(9, 40)  # two full 16-token blocks shared, the rest recomputed by samples 1, 2
    params = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(n=3, seed=11, prompt_logprobs=1, **params))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    singles = [_one(llm, prompt, seed=11 + i, **params).token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len(set(map(tuple, singles))) == 3
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    greedy = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, **GREEDY))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert greedy.outputs[0].token_ids == _one(llm, prompt, max_tokens=10, **GREEDY).token_ids


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0.0), ("repetition_penalty", 5e-324), ("repetition_penalty", 101.0), ("min_tokens", -1), ("min_tokens", 17), ("n", 0),
    ("stop", [""]), ("stop", [3]), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 200.0}),
])
def test_validation_of_the_new_fields(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})
