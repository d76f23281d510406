"""Continuous batching on one group: running requests first (decode or the next prefill chunk),
then FIFO admits.

A request is admitted only when the KV blocks for its whole life (prompt + max_tokens) are free,
so nothing admitted is ever preempted. Prompts longer than the token budget are cut into chunks.
"""
from __future__ import annotations

import itertools

from moeflow.core import Batch, Request, ScheduledSeq
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.pool import RequestPool


class ContinuousBatching(RequestPool):
    def __init__(self, allocator: BlockAllocator, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        super().__init__([allocator], max_model_len, max_num_seqs)
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self._batch_ids = itertools.count()

    @property
    def running(self) -> list[Request]:
        return self.groups[0].requests

    def add(self, request: Request) -> None:
        self.check(request, None)
        self.waiting.append(request)

    def schedule(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for r in self.running:
            if budget == 0:
                break
            seqs.append(self.seq(r, min(r.num_tokens - r.num_computed_tokens, budget)))
            budget -= seqs[-1].num_tokens
        while self.waiting and budget > 0:
            r = self.waiting[0]
            if not self.room_for(0, [r]):
                break  # FIFO: a large head request is not overtaken (no starvation)
            self.admit(0, r)
            seqs.append(self.seq(r, min(r.num_tokens, budget)))
            budget -= seqs[-1].num_tokens
        return Batch(next(self._batch_ids), tuple(seqs)) if seqs else None

    def update(self, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        return super().update(0, batch, sampled)
