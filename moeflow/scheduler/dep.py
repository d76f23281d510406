"""The synchronous baselines' scheduler (ASAP §5.1 "Default" and "ChunkedPrefill").

Every global step gives each of the N ranks one batch (possibly empty: that rank runs a dummy
step, as vLLM's data parallelism does), and no rank starts step k+1 before every rank finished
step k. "Default" assigns each waiting request, first come first served, to the rank with the
fewest tokens in this step, so ranks get batches of similar total token count. With
``chunked_prefill_size`` = C, prompts advance at most C tokens per step (the rest in later steps,
on the same rank, attending to the KV cache of earlier chunks).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from moeflow.core import Batch, Request, RequestError, RequestStatus, ScheduledSeq
from moeflow.scheduler.block_allocator import BlockAllocator


@dataclass
class _Rank:
    allocator: BlockAllocator
    requests: list[Request] = field(default_factory=list)  # admitted here, not finished


class DepScheduler:
    def __init__(self, allocators: list[BlockAllocator], max_batch_tokens: int, max_model_len: int,
                 max_num_seqs: int, chunked_prefill_size: int | None = None):
        if chunked_prefill_size is not None and not 0 < chunked_prefill_size <= max_batch_tokens:
            raise RequestError(f"chunked_prefill_size must be in [1, max_batch_tokens={max_batch_tokens}], "
                               f"got {chunked_prefill_size}")
        self.ranks = [_Rank(a) for a in allocators]
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.chunk = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.rank_of: dict[str, int] = {}
        self._batch_ids = itertools.count()

    def add(self, request: Request) -> None:
        n, total, rid = request.num_prompt_tokens, request.max_total_tokens, request.request_id
        if n == 0:
            raise RequestError(f"request {rid}: the prompt is empty")
        if total > self.max_model_len:
            raise RequestError(f"request {rid}: prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) "
                               f"= {total} exceeds the model's context of {self.max_model_len} tokens")
        if self.chunk is None and n > self.max_batch_tokens:
            raise RequestError(f"request {rid}: prompt of {n} tokens exceeds max_batch_tokens "
                               f"({self.max_batch_tokens}); use chunked prefill")
        a = self.ranks[0].allocator
        if a.blocks_for(total) > a.num_blocks:
            raise RequestError(f"request {rid}: needs {a.blocks_for(total)} KV blocks, a rank holds {a.num_blocks}")
        self.waiting.append(request)

    def _step_tokens(self, r: Request) -> int:
        """Tokens ``r`` computes in the next step: 1 when decoding, else (the next chunk of) its prompt."""
        left = r.num_tokens - r.num_computed_tokens
        return left if self.chunk is None else min(left, self.chunk)

    def schedule(self, now: float = 0.0) -> list[Batch] | None:
        """One batch per rank for the next global step, or None when no rank has anything to do."""
        plan: list[list[tuple[Request, int]]] = [[] for _ in self.ranks]
        load = [0] * len(self.ranks)
        for i, rk in enumerate(self.ranks):
            for r in rk.requests:
                n = min(self._step_tokens(r), self.max_batch_tokens - load[i])
                if n > 0:
                    plan[i].append((r, n))
                    load[i] += n
        while self.waiting:
            r = self.waiting[0]
            n = self._step_tokens(r)
            fits = [i for i, rk in enumerate(self.ranks)
                    if load[i] + n <= self.max_batch_tokens and len(rk.requests) < self.max_num_seqs
                    and rk.allocator.can_allocate(r.max_total_tokens)]
            if not fits:
                break  # FIFO: nobody overtakes the head
            i = min(fits, key=lambda j: (load[j], j))
            self.waiting.popleft()
            self._admit(i, r)
            plan[i].append((r, n))
            load[i] += n
        if not any(plan):
            return None
        return [self._batch(i, p) for i, p in enumerate(plan)]

    def _admit(self, i: int, r: Request) -> None:
        rk = self.ranks[i]
        rk.allocator.allocate(r.request_id, r.max_total_tokens)
        r.status = RequestStatus.RUNNING
        rk.requests.append(r)
        self.rank_of[r.request_id] = i

    def _batch(self, i: int, plan: list[tuple[Request, int]]) -> Batch:
        table = self.ranks[i].allocator.table
        seqs = tuple(ScheduledSeq(r.request_id, r.num_computed_tokens, n, table(r.request_id),
                                  is_last_chunk=r.num_computed_tokens + n == r.num_tokens) for r, n in plan)
        return Batch(next(self._batch_ids), seqs)

    def update(self, rank: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        rk = self.ranks[rank]
        by_id = {r.request_id: r for r in rk.requests}
        finished = []
        for s in batch.seqs:
            r = by_id.get(s.request_id)
            if r is None:  # aborted meanwhile
                continue
            r.num_computed_tokens += s.num_tokens
            if s.is_last_chunk and r.append_token(sampled[s.request_id]):
                finished.append(r)
        for r in finished:
            self._drop(r)
        return finished

    def _drop(self, r: Request) -> None:
        rk = self.ranks[self.rank_of.pop(r.request_id)]
        rk.requests.remove(r)
        rk.allocator.free(r.request_id)

    def abort(self, request_id: str, reason: str) -> Request | None:
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.status, r.finish_reason = RequestStatus.FINISHED, reason
                return r
        i = self.rank_of.get(request_id)
        if i is None:
            return None
        r = next(x for x in self.ranks[i].requests if x.request_id == request_id)
        self._drop(r)
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(rk.requests for rk in self.ranks)
