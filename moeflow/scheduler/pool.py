"""RequestPool: the requests of one deployment, and the bookkeeping every scheduler shares.

A waiting FIFO, and per group (an attention DP group, or a dep rank) the KV blocks and the
requests admitted there. The pool is the one owner of ``Request`` objects in the engine process:
everything else (engines, trackers) holds request ids. Schedulers take a pool and decide *what*
to admit and batch; the pool does the rest.

KV admission (``admission``), as vLLM's v1 scheduler does it, ``on-demand``: a waiting request is
admitted once its known tokens fit, and a request's blocks grow
as it does (``make_room`` before each step, ``seq`` takes them). When a running request cannot get
its next block, the most recently admitted running requests of its group that are not on the
workers are preempted by recompute (``preempt``: blocks freed, back to the head of the waiting
queue with the tokens generated so far, pinned to their group, whose workers keep their state),
the request itself last. ``reserve`` keeps the older policy for before/after runs: a request is
admitted only with the blocks of its whole life (prompt + max_tokens), and never preempted.

The samples of an n > 1 request (``Request.prefix_of``: sample 0) share its prefill: they wait
off the queue (``held``) until sample 0 has computed its full prompt blocks, then join the queue
head holding those blocks, pinned to its group, with only the rest of the prompt to compute.
When sample 0 is gone first (finished, aborted), they compute the prompt themselves.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeflow.config import KV_ADMISSIONS as ADMISSIONS
from moeflow.core import Batch, Request, RequestError, RequestStatus, ScheduledSeq, Work
from moeflow.scheduler.block_allocator import BlockAllocator


def resident_capacity(num_blocks: int, block_size: int, tokens: int, max_num_seqs: int) -> int:
    """How many requests that each grow to ``tokens`` one group's cache holds at once, under either
    admission: on demand they are all admitted and none is preempted once they have grown."""
    return max(0, min(max_num_seqs, num_blocks // -(-tokens // block_size)))


@dataclass
class Group:
    allocator: BlockAllocator
    requests: list[Request] = field(default_factory=list)  # admitted here, not finished, oldest first
    busy: bool = False  # running a work item (schedulers without a global step use it)
    dead: bool = False  # its process died: nothing is placed there any more (dwdp fails only that rank)
    draining: bool = False  # leaving an elastic deployment: admits nothing new, its residents finish
    preemptions: int = 0  # requests preempted here so far


class RequestPool:
    def __init__(self, allocators: list[BlockAllocator], max_model_len: int, max_num_seqs: int,
                 admission: str = "on-demand"):
        if admission not in ADMISSIONS:
            raise ValueError(f"kv admission must be one of {ADMISSIONS}, got {admission!r}")
        self.groups = [Group(a) for a in allocators]
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.admission = admission
        self.waiting: deque[Request] = deque()
        self.group_of: dict[str, int] = {}
        self.requests: dict[str, Request] = {}  # every accepted, unfinished request, by id
        self.pinned: dict[str, int] = {}  # preempted, waiting: the group whose workers hold its state
        self.in_flight: dict[str, int] = {}  # request id -> its pieces in batches not yet updated
        self.held: dict[str, list[Request]] = {}  # sample 0's id -> samples waiting for its prompt blocks
        self.leases: dict[str, int] = {}  # finished kv_handoff requests -> the group still holding their blocks

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def enqueue(self, request: Request) -> None:
        """Accept a checked request into the waiting FIFO (a later sample: see ``held``)."""
        self.requests[request.request_id] = request
        first = self.requests.get(request.prefix_of) if request.prefix_of is not None else None
        if first is not None and self.shared_len(first) > 0:
            if first.request_id in self.group_of and first.num_computed_tokens >= self.shared_len(first):
                self._share(first, request)
                self.waiting.append(request)
            else:
                self.held.setdefault(first.request_id, []).append(request)
            return
        self.waiting.append(request)

    def shared_len(self, r: Request) -> int:
        """Positions of ``r``'s prompt in full blocks, less its last token (a sample must compute
        at least that one to get its own first token)."""
        bs = self.groups[0].allocator.block_size
        return (r.num_prompt_tokens - 1) // bs * bs

    def _share(self, first: Request, r: Request) -> None:
        gid, n = self.group_of[first.request_id], self.shared_len(first)
        self.groups[gid].allocator.share(first.request_id, r.request_id, n // self.groups[gid].allocator.block_size)
        r.num_computed_tokens = n
        self.pinned[r.request_id] = gid

    def _release(self, first: Request, share: bool) -> None:
        """The samples held for ``first`` join the queue head, sharing its blocks when ``share``."""
        for r in reversed(self.held.pop(first.request_id, [])):
            if share:
                self._share(first, r)
            self.waiting.appendleft(r)

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

    def admit_tokens(self, r: Request) -> int:
        """The tokens a request needs blocks for on admission: its whole life under ``reserve``."""
        return r.max_total_tokens if self.admission == "reserve" else r.num_tokens

    def room_for(self, gid: int, reqs: list[Request]) -> bool:
        """Whether group ``gid`` can take ``reqs`` now: sequence slots, and KV blocks for their whole
        life (``reserve``) or for their known tokens (``on-demand``); a preempted request goes back to
        its own group only."""
        g = self.groups[gid]
        if any(self.pinned.get(r.request_id, gid) != gid for r in reqs):
            return False
        if g.draining and any(r.request_id not in self.pinned for r in reqs):  # its preempted come back
            return False
        need = sum(g.allocator.blocks_for(self.admit_tokens(r)) - g.allocator.num_held(r.request_id) for r in reqs)
        return need <= g.allocator.num_free and len(g.requests) + len(reqs) <= self.max_num_seqs

    def admit(self, gid: int, r: Request) -> None:
        """Move ``r`` from waiting to group ``gid`` with the KV blocks ``room_for`` counted."""
        g = self.groups[gid]
        self.waiting.remove(r)
        self.pinned.pop(r.request_id, None)
        g.allocator.grow(r.request_id, self.admit_tokens(r))
        r.status = RequestStatus.RUNNING
        g.requests.append(r)
        self.group_of[r.request_id] = gid

    def make_room(self, r: Request, upto: int, keep: set[str] = frozenset()) -> bool:
        """KV blocks for positions [0, upto) of running ``r``: taken now, preempting the most recently
        admitted requests of its group that are not on the workers nor in ``keep`` (already in the
        step being built) when the group has too few free. When even that is not enough ``r`` itself
        is preempted (unless on the workers) and False returned: it does not run this step."""
        g = self.groups[self.group_of[r.request_id]]
        a = g.allocator
        while a.blocks_for(upto) - a.num_held(r.request_id) > a.num_free:
            victim = next((v for v in reversed(g.requests) if v is not r and v.request_id not in keep
                           and v.request_id not in self.in_flight), None)
            if victim is None:
                if r.request_id not in self.in_flight and r.request_id not in keep:
                    self.preempt(r)
                return False
            self.preempt(victim)
        a.grow(r.request_id, upto)  # NOTE: not allocate: a step takes each table once, in seq
        return True

    def preempt(self, r: Request) -> None:
        """By recompute: ``r``'s blocks freed, its computed tokens forgotten, back to the head of the
        waiting queue with its tokens so far, pinned to its group (whose workers keep its state)."""
        gid = self.group_of.pop(r.request_id)
        g = self.groups[gid]
        g.requests.remove(r)
        g.allocator.free(r.request_id)
        g.preemptions += 1
        r.num_computed_tokens = 0
        r.status = RequestStatus.WAITING
        self.pinned[r.request_id] = gid
        self.waiting.appendleft(r)

    def seq(self, r: Request, num_tokens: int, start: int | None = None, last: bool | None = None) -> ScheduledSeq:
        """Positions [start, start + num_tokens) of ``r`` (start: by default, what is not yet computed;
        ``last``: whether they reach its known tokens, by default from ``r``), their KV blocks taken
        (``make_room`` found them); the piece is on the workers until ``update``."""
        start = r.num_computed_tokens if start is None else start
        rid = r.request_id
        table = self.groups[self.group_of[rid]].allocator.allocate(rid, start + num_tokens)
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        last = start + num_tokens == r.num_tokens if last is None else last
        return ScheduledSeq(rid, start, num_tokens, table, is_last_chunk=last)

    @property
    def num_preemptions(self) -> int:
        return sum(g.preemptions for g in self.groups)

    def update(self, gid: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        """Apply a finished batch of group ``gid``; returns the requests it finished."""
        by_id = {r.request_id: r for r in self.groups[gid].requests}
        finished = []
        for s in batch.seqs:
            left = self.in_flight.get(s.request_id, 0) - 1
            if left > 0:
                self.in_flight[s.request_id] = left
            else:
                self.in_flight.pop(s.request_id, None)
            r = by_id.get(s.request_id)
            if r is None:  # aborted while the batch ran
                continue
            r.num_computed_tokens += s.num_tokens
            if r.request_id in self.held and r.num_computed_tokens >= self.shared_len(r):
                self._release(r, share=True)
            if s.is_last_chunk and r.append_token(sampled[s.request_id]):
                finished.append(r)
        for r in finished:
            self._drop(r, lease=r.kv_handoff)
        return finished

    def _drop(self, r: Request, lease: bool = False) -> None:
        self._release(r, share=False)
        self.requests.pop(r.request_id, None)
        gid = self.group_of.pop(r.request_id)
        g = self.groups[gid]
        g.requests.remove(r)
        if lease:
            self.leases[r.request_id] = gid
        else:
            g.allocator.free(r.request_id)

    def end_lease(self, request_id: str) -> None:
        """The decode side took (or gave up on) a finished request's blocks: they are freed."""
        gid = self.leases.pop(request_id, None)
        if gid is not None:
            self.groups[gid].allocator.free(request_id)

    def abort(self, request_id: str, reason: str) -> Request | None:
        self.in_flight.pop(request_id, None)
        r = next((x for x in self.waiting if x.request_id == request_id), None)
        held = next((f for f in self.held.values() if any(x.request_id == request_id for x in f)), None)
        if r is not None:
            self.waiting.remove(r)
            if request_id in self.pinned:  # a later sample may hold shared blocks while it waits
                self.groups[self.pinned[request_id]].allocator.free(request_id)
            self._release(r, share=False)
            self.requests.pop(request_id, None)
        elif held is not None:
            r = next(x for x in held if x.request_id == request_id)
            held.remove(r)
            self.requests.pop(request_id, None)
        elif request_id in self.group_of:
            gid = self.group_of[request_id]
            r = next(x for x in self.groups[gid].requests if x.request_id == request_id)
            self._drop(r)
        else:
            return None
        self.pinned.pop(request_id, None)
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        return r

    def pinned_to(self, gid: int) -> list[Request]:
        """Waiting requests whose state (preempted) or blocks (later samples) are in group ``gid``."""
        return [r for r in self.waiting if self.pinned.get(r.request_id) == gid]

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.held) or any(g.requests for g in self.groups)


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
