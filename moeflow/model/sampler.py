"""Token sampling (greedy, temperature, top-k, top-p) and logprob extraction.

Logprobs are those of the raw model distribution (vLLM's default ``raw_logprobs``), independent
of temperature and truncation. Shape legend: B rows, V vocab.
"""
from __future__ import annotations

import torch

# token id -> (logprob, rank); the engine turns these into ``core.Logprob`` with decoded text.
# (Same alias as ``moeflow.messages.RawLogprobs``; the model does not import the runtime.)
RawLogprobs = dict[int, tuple[float, int]]

_GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """logits: [V] float32 -> one token id."""
    # NOTE: colder than vLLM's _SAMPLING_EPS is greedy: 1/T overflows float32 (and a T below
    # float32's smallest subnormal becomes 0), which would put inf/nan into the softmax.
    if temperature < _GREEDY_BELOW:
        return int(torch.argmax(logits))
    x = logits / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token once the mass *before* it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # NOTE: explicitly: a top_p below float32's smallest subnormal compares as 0
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> list[RawLogprobs]:
    """Top-n plus the chosen token for each row. logits: [B, V]; chosen: [B] int64."""
    lp = logits.float().log_softmax(-1)  # [B, V]
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [B]
    ranks = (lp > chosen_lp.unsqueeze(1)).sum(1) + 1  # [B]
    out: list[RawLogprobs] = []
    top_v, top_i = (torch.topk(lp, top_n, dim=-1) if top_n > 0 else (None, None))
    for b in range(lp.shape[0]):
        d: RawLogprobs = {}
        if top_n > 0:
            for r, (t, v) in enumerate(zip(top_i[b].tolist(), top_v[b].tolist())):
                d[t] = (v, r + 1)
        d[int(chosen[b])] = (float(chosen_lp[b]), int(ranks[b]))
        out.append(d)
    return out
