"""Continuous batching on one group: running requests first (decode or the next prefill chunk),
then FIFO admits (KV blocks on demand, with preemption: ``pool.py``). Prompts longer than the
token budget are cut into chunks.
"""
from __future__ import annotations

import itertools

from moeflow.core import Batch, Request, ScheduledSeq, Work
from moeflow.scheduler.pool import RequestPool, Scheduler


class ContinuousBatching(Scheduler):
    def __init__(self, pool: RequestPool, max_num_batched_tokens: int):
        super().__init__(pool)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._batch_ids = itertools.count()

    @property
    def running(self) -> list[Request]:
        return self.pool.groups[0].requests

    def add(self, request: Request) -> None:
        self.pool.check(request, None)
        self.pool.enqueue(request)

    def schedule(self, now: float = 0.0) -> list[Work]:
        pool, budget = self.pool, self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for r in list(self.running):  # oldest first; make_room may preempt the newest
            if budget == 0:
                break
            if r not in self.running:  # preempted for an older one
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if not pool.make_room(r, r.num_computed_tokens + n, {s.request_id for s in seqs}):
                continue
            seqs.append(pool.seq(r, n))
            budget -= n
        while pool.waiting and budget > 0:
            r = pool.waiting[0]
            if not pool.room_for(0, [r]):
                break  # FIFO: a large head request is not overtaken (no starvation)
            pool.admit(0, r)
            seqs.append(pool.seq(r, min(r.num_tokens - r.num_computed_tokens, budget)))
            budget -= seqs[-1].num_tokens
        return [Work(0, (Batch(next(self._batch_ids), tuple(seqs)),))] if seqs else []


def build(layout, pool: RequestPool, max_num_batched_tokens: int) -> ContinuousBatching:
    return ContinuousBatching(pool, max_num_batched_tokens)
