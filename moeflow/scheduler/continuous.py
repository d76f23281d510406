"""Continuous batching: running requests first (decode or the next prefill chunk), then FIFO admits.

A request is admitted only when the KV blocks for its whole life (prompt + max_tokens) are free,
so nothing admitted is ever preempted. Prompts longer than the token budget are cut into chunks.
"""
from __future__ import annotations

import itertools
from collections import deque

from moeflow.core import Batch, Request, RequestError, RequestStatus, ScheduledSeq
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.policy import SchedulingPolicy


class ContinuousBatching(SchedulingPolicy):
    def __init__(self, allocator: BlockAllocator, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._batch_ids = itertools.count()

    def add(self, request: Request) -> None:
        total = request.max_total_tokens
        if request.num_prompt_tokens == 0:
            raise RequestError(f"request {request.request_id}: the prompt is empty")
        if total > self.max_model_len:
            raise RequestError(f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) + "
                               f"max_tokens ({request.params.max_tokens}) = {total} exceeds the model's "
                               f"context of {self.max_model_len} tokens")
        if self.allocator.blocks_for(total) > self.allocator.num_blocks:
            raise RequestError(f"request {request.request_id}: needs {self.allocator.blocks_for(total)} KV blocks, "
                               f"the cache has {self.allocator.num_blocks}")
        self.waiting.append(request)

    def schedule(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for r in self.running:
            if budget == 0:
                break
            seqs.append(self._chunk(r, budget))
            budget -= seqs[-1].num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.allocator.can_allocate(r.max_total_tokens):
                break  # FIFO: a large head request is not overtaken (no starvation)
            self.waiting.popleft()
            self.allocator.allocate(r.request_id, r.max_total_tokens)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            seqs.append(self._chunk(r, budget))
            budget -= seqs[-1].num_tokens
        return Batch(next(self._batch_ids), tuple(seqs)) if seqs else None

    def _chunk(self, r: Request, budget: int) -> ScheduledSeq:
        start = r.num_computed_tokens
        n = min(r.num_tokens - start, budget)
        return ScheduledSeq(r.request_id, start, n, self.allocator.table(r.request_id),
                            is_last_chunk=start + n == r.num_tokens)

    def update(self, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        by_id = {r.request_id: r for r in self.running}
        finished = []
        for s in batch.seqs:
            r = by_id.get(s.request_id)
            if r is None:  # aborted while the batch ran
                continue
            r.num_computed_tokens += s.num_tokens
            if s.is_last_chunk and r.append_token(sampled[s.request_id]):
                finished.append(r)
        for r in finished:
            self._release(r)
        return finished

    def _release(self, r: Request) -> None:
        self.running.remove(r)
        self.allocator.free(r.request_id)

    def abort(self, request_id: str, reason: str) -> Request | None:
        for r in list(self.waiting) + self.running:
            if r.request_id == request_id:
                if r in self.running:
                    self._release(r)
                else:
                    self.waiting.remove(r)
                r.status, r.finish_reason = RequestStatus.FINISHED, reason
                return r
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
