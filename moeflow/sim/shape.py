"""AttnShape: what attention cost depends on, read off a batch of scheduled sequences.

Attention grows with the (query, key) pairs of a batch — Σ sᵢ²/2 for fresh prompts — not with
its token count; that is the DP imbalance ASAP §2.2 is about.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeflow.core import Batch


def _capped_pairs(n: int, cap: int) -> int:
    """Σ_{p<n} min(p + 1, cap): keys seen by the queries at positions 0..n-1 (cap 0: uncapped)."""
    if cap <= 0 or n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


@dataclass(frozen=True)
class AttnShape:
    num_tokens: int  # Σ q: tokens computed this step
    num_seqs: int
    num_pairs: int  # causal (query, key) pairs over the whole context: Σ q·ctx + q(q+1)/2
    num_sparse_pairs: int  # the same with each query capped at the model's index_topk keys
    num_sampled: int  # sequences that reach their end and sample a token
    # keys each sequence's attention reads from the KV cache, summed: its context (decode reads it
    # all for one token, so this, not pairs, prices decode), and the same capped at index_topk
    num_keys: int = 0
    num_sparse_keys: int = 0
    # DSA only (topk > 0): pairs of the sequences whose context ends within topk (all their keys are
    # selected, so dense MHA gives the same result), the longest context, and the queries that see
    # more than topk keys (the indexer must pick their top-k)
    num_short_pairs: int = 0
    max_context: int = 0
    num_long_queries: int = 0
    # decode rows (one new token after a cached context): a profiled cost prices them apart, as the
    # engine runs them through its own kernel
    num_decode_seqs: int = 0
    num_decode_keys: int = 0

    @classmethod
    def of(cls, spans: list[tuple[int, int, bool]], topk: int = 0) -> "AttnShape":
        """spans: (start, num_tokens, samples) per sequence."""
        tokens = pairs = sparse = sampled = keys = sparse_keys = short = longest = long_queries = dseqs = dkeys = 0
        for start, n, samples in spans:
            end = start + n
            tokens += n
            p = _capped_pairs(end, 0) - _capped_pairs(start, 0)
            pairs += p
            sparse += _capped_pairs(end, topk) - _capped_pairs(start, topk) if topk else 0
            sampled += samples
            keys += end
            sparse_keys += min(end, topk) if topk else end
            longest = max(longest, end)
            if n == 1 and start > 0:
                dseqs, dkeys = dseqs + 1, dkeys + end
            if topk:
                short += p if end <= topk else 0
                long_queries += end - max(start, topk) if end > topk else 0
        return cls(tokens, len(spans), pairs, sparse if topk else pairs, sampled, keys, sparse_keys, short, longest,
                   long_queries, dseqs, dkeys)

    @classmethod
    def of_batch(cls, batch: Batch, topk: int = 0) -> "AttnShape":
        return cls.of([(s.start, s.num_tokens, s.is_last_chunk) for s in batch.seqs], topk)

    @classmethod
    def sum(cls, shapes: list["AttnShape"]) -> "AttnShape":
        summed = ("num_tokens", "num_seqs", "num_pairs", "num_sparse_pairs", "num_sampled", "num_keys",
                  "num_sparse_keys", "num_short_pairs", "num_long_queries", "num_decode_seqs", "num_decode_keys")
        return cls(**{f: sum(getattr(s, f) for s in shapes) for f in summed},
                   max_context=max((s.max_context for s in shapes), default=0))
