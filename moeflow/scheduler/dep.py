"""The synchronous baselines' scheduler (ASAP §5.1 "Default" and "ChunkedPrefill").

Every global step gives each of the N ranks one batch (possibly empty: that rank runs a dummy
step, as vLLM's data parallelism does), and no rank starts step k+1 before every rank finished
step k. "Default" assigns each waiting request, first come first served, to the rank with the
fewest tokens in this step, so ranks get batches of similar total token count. With
``chunked_prefill_size`` = C, prompts advance at most C tokens per step (the rest in later steps,
on the same rank, attending to the KV cache of earlier chunks).

``placement="round_robin"`` instead fixes each request's rank when it arrives, in turn, as
SGLang's data-parallel controller does by default: a rank's queue then waits for that rank even
when another one has room (each rank stays first come first served).
"""
from __future__ import annotations

import itertools

PLACEMENTS = ("least_loaded", "round_robin")

from moeflow.core import Batch, Request, RequestError
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.pool import RequestPool


class DepScheduler(RequestPool):
    def __init__(self, allocators: list[BlockAllocator], max_batch_tokens: int, max_model_len: int,
                 max_num_seqs: int, chunked_prefill_size: int | None = None, placement: str = "least_loaded"):
        if placement not in PLACEMENTS:
            raise RequestError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if chunked_prefill_size is not None and not 0 < chunked_prefill_size <= max_batch_tokens:
            raise RequestError(f"chunked_prefill_size must be in [1, max_batch_tokens={max_batch_tokens}], "
                               f"got {chunked_prefill_size}")
        super().__init__(allocators, max_model_len, max_num_seqs)
        self.max_batch_tokens = max_batch_tokens
        self.chunk = chunked_prefill_size
        self.placement = placement
        self._batch_ids = itertools.count()
        self._turn = itertools.cycle(range(len(allocators)))
        self.rank_of: dict[str, int] = {}  # round_robin: the rank fixed at arrival

    def add(self, request: Request) -> None:
        self.check(request, None if self.chunk else self.max_batch_tokens, "; use chunked prefill")
        self.waiting.append(request)
        if self.placement == "round_robin":
            self.rank_of[request.request_id] = next(self._turn)

    def abort(self, request_id: str, reason: str) -> Request | None:
        self.rank_of.pop(request_id, None)
        return super().abort(request_id, reason)

    def _step_tokens(self, r: Request) -> int:
        """Tokens ``r`` computes in the next step: 1 when decoding, else (the next chunk of) its prompt."""
        left = r.num_tokens - r.num_computed_tokens
        return left if self.chunk is None else min(left, self.chunk)

    def schedule(self, now: float = 0.0) -> list[Batch] | None:
        """One batch per rank for the next global step, or None when no rank has anything to do."""
        plan: list[list[tuple[Request, int]]] = [[] for _ in self.groups]
        load = [0] * len(self.groups)
        for i, g in enumerate(self.groups):
            for r in g.requests:
                n = min(self._step_tokens(r), self.max_batch_tokens - load[i])
                if n > 0:
                    plan[i].append((r, n))
                    load[i] += n
        blocked: set[int] = set()  # round_robin: ranks whose queue head did not fit
        for r in list(self.waiting):
            if len(blocked) == len(self.groups):
                break
            n = self._step_tokens(r)
            ranks = [self.rank_of[r.request_id]] if self.placement == "round_robin" else range(len(self.groups))
            fits = [i for i in ranks if i not in blocked
                    and load[i] + n <= self.max_batch_tokens and self.room_for(i, [r])]
            if not fits:
                if self.placement == "least_loaded":
                    break  # FIFO: nobody overtakes the head
                blocked.add(ranks[0])  # FIFO per rank
                continue
            i = min(fits, key=lambda j: (load[j], j))
            self.admit(i, r)
            self.rank_of.pop(r.request_id, None)
            plan[i].append((r, n))
            load[i] += n
        if not any(plan):
            return None
        return [Batch(next(self._batch_ids), tuple(self.seq(r, n) for r, n in p)) for p in plan]
