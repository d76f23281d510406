"""The batched sampler: one pass over the [B, V] logits of a step for every request's settings,
and logprob extraction.

Steps, in vLLM's order: tokens banned this step (EOS and stop tokens before ``min_tokens``) and
``logit_bias``; the penalties (repetition over prompt and output, CTRL's divide-or-multiply;
presence and frequency over the output, OpenAI's); greedy rows take the argmax of that; the others
are divided by their temperature, then ``min_p``, ``top_k`` and ``top_p`` cut the tail, and one
draw is made: one ``multinomial`` for all unseeded rows, one per seeded row on its own generator
(so a seeded request samples the same in any batch). Each step runs only when some row needs it,
on the rows that need it. ``sampler_reference.py`` is the per-row oracle the tests compare with.

Logprobs are those of the raw model distribution (vLLM's default ``raw_logprobs``), independent
of temperature, penalties and truncation. Shape legend: B rows, V vocab.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# token id -> (logprob, rank); the engine turns these into ``core.Logprob`` with decoded text.
# (Same alias as ``moeflow.messages.RawLogprobs``; the model does not import the runtime.)
RawLogprobs = dict[int, tuple[float, int]]

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class RowSampling:
    """One row's settings for this step (the runner makes them from a request's SamplingParams)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned: tuple[int, ...] = ()  # ids that cannot be sampled this step

    @property
    def greedy(self) -> bool:
        # NOTE: colder than vLLM's _SAMPLING_EPS is greedy: 1/T overflows float32 (and a T below
        # float32's smallest subnormal becomes 0), which would put inf/nan into the softmax.
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _col(values: list, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)  # [b, 1]


def _counts(ids: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[b, V] float32: how often each id occurs in each row's ``ids``."""
    width = max(1, max(len(x) for x in ids))
    # NOTE: padded with the id ``vocab``, whose column is dropped
    padded = torch.tensor([list(x) + [vocab] * (width - len(x)) for x in ids], dtype=torch.int64, device=device)
    out = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    return out.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))[:, :vocab]


def _processed(logits: torch.Tensor, rows: Sequence[RowSampling], prompts: Sequence[Sequence[int]],
               outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, V] float32: the logits after bans, bias and penalties."""
    x = logits.float().clone()
    dev, vocab = x.device, x.shape[1]
    idx = [(b, t, v) for b, r in enumerate(rows) for t, v in r.logit_bias]
    if idx:
        rb, cb, vb = zip(*idx)
        x.index_put_((torch.tensor(rb, device=dev), torch.tensor(cb, device=dev)), torch.tensor(vb, device=dev),
                     accumulate=True)
    banned = [(b, t) for b, r in enumerate(rows) for t in r.banned]
    if banned:
        rb, cb = zip(*banned)
        x[torch.tensor(rb, device=dev), torch.tensor(cb, device=dev)] = float("-inf")
    pen = [b for b, r in enumerate(rows) if r.penalized]
    if pen:
        sel = torch.tensor(pen, device=dev)
        xp = x[sel]
        out_counts = _counts([outputs[b] for b in pen], vocab, dev)  # [p, V]
        rep = _col([rows[b].repetition_penalty for b in pen], dev)
        if any(rows[b].repetition_penalty != 1 for b in pen):
            seen = (_counts([prompts[b] for b in pen], vocab, dev) > 0) | (out_counts > 0)
            xp = torch.where(seen, torch.where(xp > 0, xp / rep, xp * rep), xp)
        xp = xp - _col([rows[b].frequency_penalty for b in pen], dev) * out_counts \
            - _col([rows[b].presence_penalty for b in pen], dev) * (out_counts > 0).float()
        x[sel] = xp
    return x


def _truncated(x: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """[b, V]: tempered logits of sampled rows with min_p, top_k and top_p applied (-inf = cut)."""
    dev, vocab = x.device, x.shape[1]
    if any(r.min_p > 0 for r in rows):
        probs = x.softmax(-1)
        floor = _col([r.min_p for r in rows], dev) * probs.max(-1, keepdim=True).values
        x = x.masked_fill(probs < floor, float("-inf"))
    cut_k = any(0 < r.top_k < vocab for r in rows)
    cut_p = any(r.top_p < 1.0 for r in rows)
    if not (cut_k or cut_p):
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [b, V]
    if cut_k:
        k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=dev)
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))  # [b, 1]; ties with the k-th stay
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if cut_p:
        probs = sorted_x.softmax(-1)
        # drop a token once the mass *before* it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= _col([r.top_p for r in rows], dev)
        drop[:, 0] = False  # NOTE: explicitly: a top_p below float32's smallest subnormal compares as 0
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def probabilities(logits: torch.Tensor, rows: Sequence[RowSampling], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, V] float32: the distribution each row's next token is drawn from (one-hot for greedy rows).
    ``prompts``/``outputs``: each row's prompt and output ids so far (read for penalized rows only)."""
    x = _processed(logits, rows, prompts, outputs)
    probs = torch.zeros_like(x)
    greedy = [b for b, r in enumerate(rows) if r.greedy]
    if greedy:
        sel = torch.tensor(greedy, device=x.device)
        probs[sel, x[sel].argmax(-1)] = 1.0
    sampled = [b for b, r in enumerate(rows) if not r.greedy]
    if sampled:
        sel = torch.tensor(sampled, device=x.device)
        tempered = x[sel] / _col([rows[b].temperature for b in sampled], x.device)
        probs[sel] = _truncated(tempered, [rows[b] for b in sampled]).softmax(-1)
    return probs


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
                  default: torch.Generator) -> torch.Tensor:
    """[B] int64 on the logits' device, one token id per row, nothing read back to the host;
    ``generators[b]`` is row b's own (seeded) generator or None."""
    probs = probabilities(logits, rows, prompts, outputs)
    dev = probs.device
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=dev)
    greedy = [b for b, r in enumerate(rows) if r.greedy]
    if greedy:
        sel = torch.tensor(greedy, device=dev)
        tokens[sel] = probs[sel].argmax(-1)
    shared = [b for b, r in enumerate(rows) if not r.greedy and generators[b] is None]
    if shared:
        sel = torch.tensor(shared, device=dev)
        tokens[sel] = torch.multinomial(probs[sel], 1, generator=default).squeeze(1)
    for b, r in enumerate(rows):  # NOTE: one draw per seeded row, on its own generator (no batched form)
        if not r.greedy and generators[b] is not None:
            tokens[b:b + 1] = torch.multinomial(probs[b], 1, generator=generators[b])
    return tokens


def sample(logits: torch.Tensor, rows: Sequence[RowSampling], prompts: Sequence[Sequence[int]],
           outputs: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None],
           default: torch.Generator) -> list[int]:
    """``sample_tokens``, read back: one token id per row."""
    return sample_tokens(logits, rows, prompts, outputs, generators, default).tolist()


def logprobs_packed(logits: torch.Tensor, chosen: torch.Tensor, most: int) -> torch.Tensor:
    """[B, 2 most + 3] float64 on the logits' device: each row's top ``most`` logprobs, their ids,
    then the chosen id, its logprob and its rank (ids and ranks are exact in float64), so that one
    copy brings everything to the host (``logprobs_unpacked``). logits: [B, V]; chosen: [B] int64."""
    lp = logits.float().log_softmax(-1)  # [B, V]
    chosen_lp = lp.gather(1, chosen.unsqueeze(1))  # [B, 1]
    ranks = (lp > chosen_lp).sum(1, keepdim=True) + 1  # [B, 1]
    top_v, top_i = torch.topk(lp, most, dim=-1) if most > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return torch.cat([top_v.double(), top_i.double(), chosen.unsqueeze(1).double(), chosen_lp.double(),
                      ranks.double()], dim=1)


def logprobs_unpacked(packed: list[list[float]], top_n: Sequence[int]) -> list[RawLogprobs]:
    """``logprobs_packed``'s rows, read back, as each row's top ``top_n[b]`` plus its chosen token."""
    out: list[RawLogprobs] = []
    for row, n in zip(packed, top_n):
        most = (len(row) - 3) // 2
        d: RawLogprobs = {int(row[most + r]): (row[r], r + 1) for r in range(n)}
        d[int(row[-3])] = (row[-2], int(row[-1]))
        out.append(d)
    return out


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: int | Sequence[int]) -> list[RawLogprobs]:
    """Top-n plus the chosen token for each row (one read back). logits: [B, V]; chosen: [B] int64;
    top_n: one for all rows or one per row."""
    ns = [top_n] * logits.shape[0] if isinstance(top_n, int) else list(top_n)
    return logprobs_unpacked(logprobs_packed(logits, chosen, max(ns, default=0)).tolist(), ns)
