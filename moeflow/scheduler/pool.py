"""RequestPool: the requests of one deployment, and the bookkeeping every scheduler shares.

A waiting FIFO, and per group (an attention DP group, or a dep rank) the KV blocks and the
requests admitted there. The pool is the one owner of ``Request`` objects in the engine process:
everything else (engines, trackers) holds request ids. Schedulers take a pool and decide *what*
to admit and batch; the pool does the rest.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeflow.core import Batch, Request, RequestError, RequestStatus, ScheduledSeq, Work
from moeflow.scheduler.block_allocator import BlockAllocator


@dataclass
class Group:
    allocator: BlockAllocator
    requests: list[Request] = field(default_factory=list)  # admitted here, not finished
    busy: bool = False  # running a work item (schedulers without a global step use it)
    dead: bool = False  # its process died: nothing is placed there any more (dwdp fails only that rank)


class RequestPool:
    def __init__(self, allocators: list[BlockAllocator], max_model_len: int, max_num_seqs: int):
        self.groups = [Group(a) for a in allocators]
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.group_of: dict[str, int] = {}
        self.requests: dict[str, Request] = {}  # every accepted, unfinished request, by id

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def enqueue(self, request: Request) -> None:
        """Accept a checked request into the waiting FIFO."""
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def check(self, request: Request, max_prompt_tokens: int | None, hint: str = "") -> None:
        """Reject what could never run, naming the numbers (nothing is queued on error)."""
        n, total, rid = request.num_prompt_tokens, request.max_total_tokens, request.request_id
        if n == 0:
            raise RequestError(f"request {rid}: the prompt is empty")
        if total > self.max_model_len:
            raise RequestError(f"request {rid}: prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) "
                               f"= {total} exceeds the model's context of {self.max_model_len} tokens")
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise RequestError(f"request {rid}: prompt of {n} tokens exceeds max_batch_tokens "
                               f"({max_prompt_tokens}){hint}")
        a = self.groups[0].allocator
        if a.blocks_for(total) > a.num_blocks:
            raise RequestError(f"request {rid}: needs {a.blocks_for(total)} KV blocks, the cache has {a.num_blocks}")

    def room_for(self, gid: int, reqs: list[Request]) -> bool:
        """Whether group ``gid`` can hold ``reqs`` for their whole life (KV blocks, sequence slots)."""
        g = self.groups[gid]
        need = sum(g.allocator.blocks_for(r.max_total_tokens) for r in reqs)
        return need <= g.allocator.num_free and len(g.requests) + len(reqs) <= self.max_num_seqs

    def admit(self, gid: int, r: Request) -> None:
        """Move ``r`` from waiting to group ``gid`` with the KV blocks of its whole life."""
        g = self.groups[gid]
        self.waiting.remove(r)
        g.allocator.allocate(r.request_id, r.max_total_tokens)
        r.status = RequestStatus.RUNNING
        g.requests.append(r)
        self.group_of[r.request_id] = gid

    def seq(self, r: Request, num_tokens: int, start: int | None = None) -> ScheduledSeq:
        """Positions [start, start + num_tokens) of ``r`` (start: by default, what is not yet computed)."""
        start = r.num_computed_tokens if start is None else start
        table = self.groups[self.group_of[r.request_id]].allocator.table(r.request_id)
        return ScheduledSeq(r.request_id, start, num_tokens, table, is_last_chunk=start + num_tokens == r.num_tokens)

    def update(self, gid: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished batch of group ``gid``; returns the requests it finished."""
        by_id = {r.request_id: r for r in self.groups[gid].requests}
        finished = []
        for s in batch.seqs:
            r = by_id.get(s.request_id)
            if r is None:  # aborted while the batch ran
                continue
            r.num_computed_tokens += s.num_tokens
            if s.is_last_chunk and r.append_token(sampled[s.request_id]):
                finished.append(r)
        for r in finished:
            self._drop(r)
        return finished

    def _drop(self, r: Request) -> None:
        self.requests.pop(r.request_id, None)
        g = self.groups[self.group_of.pop(r.request_id)]
        g.requests.remove(r)
        g.allocator.free(r.request_id)

    def abort(self, request_id: str, reason: str) -> Request | None:
        r = next((x for x in self.waiting if x.request_id == request_id), None)
        if r is not None:
            self.waiting.remove(r)
            self.requests.pop(request_id, None)
        elif request_id in self.group_of:
            gid = self.group_of[request_id]
            r = next(x for x in self.groups[gid].requests if x.request_id == request_id)
            self._drop(r)
        else:
            return None
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(g.requests for g in self.groups)


class Scheduler:
    """What every mode's scheduler is: a policy over a ``RequestPool``.

    ``add`` on arrival, ``schedule(now)`` -> work items for idle groups, ``update`` with each
    finished batch, ``release`` when a group finished its work item. The engine and the
    simulator drive every scheduler through exactly these calls.
    """

    def __init__(self, pool: RequestPool):
        self.pool = pool

    def add(self, request: Request) -> None:
        """Check (raising RequestError, nothing queued) and queue."""
        raise NotImplementedError

    def schedule(self, now: float) -> list[Work]:
        raise NotImplementedError

    def update(self, group: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        return self.pool.update(group, batch, sampled)

    def release(self, group: int) -> None:
        """The group finished its work item (schedulers without a global step wait for this)."""
        self.pool.groups[group].busy = False

    def abort(self, request_id: str, reason: str) -> Request | None:
        return self.pool.abort(request_id, reason)

    def has_unfinished(self) -> bool:
        return self.pool.has_unfinished()

    def next_wakeup_s(self) -> float | None:
        """When waiting work may become schedulable with no other event (a batch falling due)."""
        return None
