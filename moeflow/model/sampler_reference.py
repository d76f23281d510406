"""The slow oracle of ``sampler.py``: one row at a time, each step written out on the [V] logits
(Python loops over the token history for the penalties). Tests compare the batched sampler's
distributions with these; nothing in the engine calls them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from moeflow.model.sampler import RowSampling


def reference_probabilities(logits: torch.Tensor, row: RowSampling, prompt: Sequence[int],
                            output: Sequence[int]) -> torch.Tensor:
    """logits: [V] -> [V] float32, the distribution the row's next token is drawn from."""
    x = logits.float().clone()
    for t, v in row.logit_bias:
        x[t] += v
    for t in row.banned:
        x[t] = float("-inf")
    counts = Counter(output)
    if row.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
    for t, c in counts.items():
        x[t] -= row.frequency_penalty * c + row.presence_penalty
    if row.greedy:
        return torch.nn.functional.one_hot(torch.argmax(x), x.numel()).float()
    return tempered_probabilities(x, row.temperature, row.top_k, row.top_p, row.min_p)


def tempered_probabilities(x: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float = 0.0) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, min_p, top_k, top_p (in that order)."""
    x = x / temperature
    if min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p * p.max(), float("-inf"))
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        kept = torch.full_like(sorted_x, float("-inf"))
        mass = 0.0
        for i in range(sorted_x.numel()):  # keep tokens until the mass before the next reaches top_p
            if i > 0 and mass >= top_p:
                break
            kept[i] = sorted_x[i]
            mass += float(probs[i])
        x = torch.empty_like(x).scatter_(0, order, kept)
    return x.softmax(-1)


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """logits: [V] float32 -> one token id (temperature, top-k, top-p only)."""
    row = RowSampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if row.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(tempered_probabilities(logits.float(), temperature, top_k, top_p), 1,
                                 generator=generator))
