"""The batched sampler (model/sampler.py) against its per-row oracle (model/sampler_reference.py)
and against transformers' logits processors, on random logits; and that it is batched: one
multinomial for the unseeded rows of a step, whatever their number."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.model.sampler import RowSampling, probabilities, sample
from moeflow.model.sampler_reference import reference_probabilities

V = 300


def _logits(b: int, seed: int) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def _random_row(rng: random.Random) -> RowSampling:
    pick = rng.random
    return RowSampling(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.6]),
        top_k=rng.choice([-1, 0, 1, 5, 40, V, V + 3]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.1]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]) if pick() < 0.5 else 0.0,
        frequency_penalty=rng.choice([0.0, 0.3, -0.4]) if pick() < 0.5 else 0.0,
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if pick() < 0.5 else 1.0,
        logit_bias=tuple(sorted({rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(4))}.items())),
        banned=tuple(sorted({rng.randrange(V) for _ in range(rng.randrange(3))})))


@pytest.mark.parametrize("seed", range(6))
def test_batched_distributions_equal_the_per_row_oracle(seed):
    rng = random.Random(seed)
    b = 16
    rows = [_random_row(rng) for _ in range(b)]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 30))] for _ in range(b)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 20))] for _ in range(b)]
    logits = _logits(b, seed)
    got = probabilities(logits, rows, prompts, outputs)
    for i in range(b):
        want = reference_probabilities(logits[i], rows[i], prompts[i], outputs[i])
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"row {i} {rows[i]}: {m}")


def test_each_step_against_transformers_logits_processors():
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper)

    logits = _logits(1, 9)  # [1, V]
    prompt, output = [3, 17, 17, 250], [17, 99, 5, 99]
    ids = torch.tensor([prompt + output])

    def ours(**kw) -> torch.Tensor:
        return probabilities(logits, [RowSampling(**kw)], [prompt], [output])[0]

    def theirs(*processors) -> torch.Tensor:
        x = logits.clone()
        for p in processors:
            x = p(ids, x)
        return x.softmax(-1)[0]

    close = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(repetition_penalty=1.7), theirs(RepetitionPenaltyLogitsProcessor(1.7)), **close)
    torch.testing.assert_close(ours(min_p=0.2), theirs(MinPLogitsWarper(0.2)), **close)
    torch.testing.assert_close(ours(top_k=7), theirs(TopKLogitsWarper(7)), **close)
    torch.testing.assert_close(ours(top_p=0.6), theirs(TopPLogitsWarper(0.6)), **close)
    bias = {(12,): 4.0, (200,): -50.0}
    torch.testing.assert_close(ours(logit_bias=((12, 4.0), (200, -50.0))), theirs(SequenceBiasLogitsProcessor(bias)),
                               **close)
    # min_tokens: EOS 250 cannot come while the output is shorter than 6
    torch.testing.assert_close(ours(banned=(250,)), theirs(MinNewTokensLengthLogitsProcessor(len(prompt), 6, 250)),
                               **close)


def test_presence_and_frequency_follow_openais_formula():
    """OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty, over the output."""
    logits = _logits(1, 4)
    output = [7, 7, 7, 11]
    got = probabilities(logits, [RowSampling(presence_penalty=0.5, frequency_penalty=0.25)], [[7, 40]], [output])[0]
    want = logits[0].clone()
    want[7] -= 3 * 0.25 + 0.5
    want[11] -= 0.25 + 0.5
    torch.testing.assert_close(got, want.softmax(-1))


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits = _logits(2, 5)
    top = int(logits[0].argmax())
    rows = [RowSampling(temperature=0.0, logit_bias=((top, -100.0),)), RowSampling(temperature=0.0, banned=(top,))]
    second = int(logits[0].topk(2).indices[1])
    assert sample(logits[[0, 0]], rows, [(), ()], [(), ()], [None, None], torch.Generator()) == [second, second]


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_unseeded_rows_draw_in_one_call_seeded_rows_on_their_own_generators():
    rng = random.Random(0)
    rows = [RowSampling(temperature=1.0, top_k=rng.choice([-1, 10]), top_p=rng.choice([1.0, 0.8])) for _ in range(24)]
    gens = [None] * 20 + [torch.Generator().manual_seed(s) for s in range(4)]
    logits = _logits(24, 1)
    with _Count() as count:
        sample(logits, rows, [()] * 24, [()] * 24, gens, torch.Generator().manual_seed(0))
    assert count.calls.get("multinomial") == 1 + 4, count.calls  # not one per row
    assert count.calls.get("sort") == 1  # top-k and top-p of every row from one sort
    # a seeded row draws the same alone and in the batch
    alone = sample(logits[20:21], rows[20:21], [()], [()], [torch.Generator().manual_seed(0)], torch.Generator())
    batch = sample(logits, rows, [()] * 24, [()] * 24,
                   [None] * 20 + [torch.Generator().manual_seed(s) for s in range(4)], torch.Generator())
    assert batch[20] == alone[0]


def test_draws_follow_the_distribution():
    logits = _logits(1, 2)[0]
    row = RowSampling(temperature=0.8, top_k=20, min_p=0.02)
    p = reference_probabilities(logits, row, (), ())
    n = 4000
    draws = sample(logits.expand(n, V), [row] * n, [()] * n, [()] * n, [None] * n, torch.Generator().manual_seed(1))
    freq = torch.bincount(torch.tensor(draws), minlength=V).float() / n
    assert set(draws) <= set(torch.nonzero(p).flatten().tolist())
    assert (freq - p).abs().max() < 5 * (0.25 / n) ** 0.5
