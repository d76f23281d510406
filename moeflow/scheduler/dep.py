"""The synchronous baselines' scheduler (ASAP §5.1 "Default" and "ChunkedPrefill").

Every global step gives each of the N ranks one batch (possibly empty: that rank runs a dummy
step, as vLLM's data parallelism does), and no rank starts step k+1 before every rank finished
step k. With ``chunked_prefill_size`` = C, prompts advance at most C tokens per step (the rest in
later steps, on the same rank, attending to the KV cache of earlier chunks). Where a waiting
request goes is a ``Placement`` policy (siblings below).
"""
from __future__ import annotations

import itertools

from moeflow.core import Batch, Request, Work
from moeflow.scheduler.pool import RequestPool, Scheduler


class Placement:
    """Which ranks may take a waiting request, and what a rank that cannot take its head does."""

    stops_at_blocked_head: bool = True  # FIFO over all ranks: nobody overtakes the head

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks

    def on_arrival(self, request: Request) -> None:
        pass

    def candidates(self, request: Request) -> list[int]:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """The request was admitted or aborted: nothing left to place."""

    def exclude(self, rank: int) -> None:
        """``rank`` is gone: place nothing there from now on."""

    def include(self, rank: int) -> None:
        """``rank`` is back (a replaced dwdp rank): place requests there again."""


class LeastLoaded(Placement):
    """"Default": each waiting request, first come first served, to the rank with the fewest
    tokens in this step, so ranks get batches of similar total token count."""

    def __init__(self, num_ranks: int):
        super().__init__(num_ranks)
        self._alive = list(range(num_ranks))

    def candidates(self, request):
        return list(self._alive)

    def exclude(self, rank):
        self._alive = [r for r in self._alive if r != rank]

    def include(self, rank):
        if rank not in self._alive:
            self._alive = sorted([*self._alive, rank])


class RoundRobin(Placement):
    """SGLang's data-parallel controller: a request's rank is fixed at arrival, in turn; a rank's
    queue then waits for that rank even when another has room (each rank stays FIFO)."""

    stops_at_blocked_head = False

    def __init__(self, num_ranks: int):
        super().__init__(num_ranks)
        self._alive = list(range(num_ranks))
        self._turn = itertools.cycle(self._alive)
        self.rank_of: dict[str, int] = {}

    def exclude(self, rank):
        self._alive = [r for r in self._alive if r != rank]
        self._turn = itertools.cycle(self._alive)
        for rid, r in self.rank_of.items():  # requests fixed to the dead rank move on, in turn
            if r == rank and self._alive:
                self.rank_of[rid] = next(self._turn)

    def include(self, rank):
        if rank not in self._alive:
            self._alive = sorted([*self._alive, rank])
            self._turn = itertools.cycle(self._alive)

    def on_arrival(self, request):
        self.rank_of[request.request_id] = next(self._turn)

    def candidates(self, request):
        return [self.rank_of[request.request_id]]

    def forget(self, request_id):
        self.rank_of.pop(request_id, None)


PLACEMENTS: dict[str, type[Placement]] = {"least_loaded": LeastLoaded, "round_robin": RoundRobin}


class DepScheduler(Scheduler):
    def __init__(self, pool: RequestPool, placement: Placement, max_batch_tokens: int,
                 chunked_prefill_size: int | None = None):
        super().__init__(pool)
        self.placement = placement
        self.max_batch_tokens = max_batch_tokens
        self.chunk = chunked_prefill_size
        self._batch_ids = itertools.count()

    def add(self, request: Request) -> None:
        self.pool.check(request, None if self.chunk else self.max_batch_tokens, "; use chunked prefill")
        self.pool.enqueue(request)
        self.placement.on_arrival(request)

    def abort(self, request_id: str, reason: str) -> Request | None:
        self.placement.forget(request_id)
        return super().abort(request_id, reason)

    def lose(self, rank: int) -> list[Request]:
        """``rank``'s process is gone: nothing is placed there until ``rejoin``; returns the requests
        it held, running or waiting pinned to it (their caller ends them)."""
        group = self.pool.groups[rank]
        group.dead, group.busy = True, True
        self.placement.exclude(rank)
        return list(group.requests) + self.pool.pinned_to(rank)

    def rejoin(self, rank: int) -> None:
        group = self.pool.groups[rank]
        group.dead, group.busy = False, False
        self.placement.include(rank)

    def _start(self, r: Request) -> int:
        """The first position ``r``'s next step computes."""
        return r.num_computed_tokens

    def _step_tokens(self, r: Request) -> int:
        """Tokens ``r`` computes in the next step: 1 when decoding, else (the next chunk of) its prompt."""
        left = r.num_tokens - r.num_computed_tokens
        # NOTE: without chunked prefill a prompt fits a batch (add checks it), but a preempted request's
        # recompute (its prompt and tokens so far) may not: it comes back in max_batch_tokens pieces
        return min(left, self.chunk or self.max_batch_tokens)

    def schedule(self, now: float = 0.0) -> list[Work]:
        """One work item per rank for the next global step (empty batches included), or [] when
        no rank has anything to do."""
        plan = self._plan(set(range(len(self.pool.groups))))
        if not any(plan):
            return []
        return [Work(i, (self._batch(p),)) for i, p in enumerate(plan)]

    def _batch(self, pieces: list[tuple[Request, int]]) -> Batch:
        return Batch(next(self._batch_ids), tuple(self.pool.seq(r, n) for r, n in pieces))

    def _plan(self, ranks: set[int]) -> list[list[tuple[Request, int]]]:
        """Per rank, (request, tokens) of its next batch: its running requests' next step first,
        then waiting requests placed FIFO by the placement policy; only ``ranks`` get anything."""
        pool = self.pool
        plan: list[list[tuple[Request, int]]] = [[] for _ in pool.groups]
        load = [0] * len(pool.groups)
        for i, g in enumerate(pool.groups):
            if i not in ranks:
                continue
            taken: set[str] = set()  # already in this step: make_room must not preempt them
            for r in list(g.requests):  # oldest first; make_room may preempt the newest
                if pool.group_of.get(r.request_id) != i:  # preempted by an older one's make_room
                    continue
                n = min(self._step_tokens(r), self.max_batch_tokens - load[i])
                if n > 0 and pool.make_room(r, self._start(r) + n, taken):
                    plan[i].append((r, n))
                    taken.add(r.request_id)
                    load[i] += n
        blocked: set[int] = set()  # ranks whose queue head did not fit (round robin)
        for r in list(pool.waiting):
            if len(blocked) == len(pool.groups):
                break
            n = self._step_tokens(r)
            # a preempted request goes back to its own rank only, even one the placement left (it drains)
            pinned = pool.pinned.get(r.request_id)
            candidates = [pinned] if pinned is not None else self.placement.candidates(r)
            # the least loaded rank that can take it (tried in that order: room_for is the dear test)
            i = next((i for i in sorted(candidates, key=lambda j: (load[j], j)) if i in ranks and i not in blocked
                      and load[i] + n <= self.max_batch_tokens and pool.room_for(i, [r])), None)
            if i is None:
                if self.placement.stops_at_blocked_head:
                    break
                blocked.add(candidates[0])
                continue
            pool.admit(i, r)
            self.placement.forget(r.request_id)
            plan[i].append((r, n))
            load[i] += n
        return plan


def build(layout, pool: RequestPool, max_num_batched_tokens: int) -> DepScheduler:
    return DepScheduler(pool, PLACEMENTS[layout.placement](len(pool.groups)), layout.max_batch_tokens,
                        layout.chunked_prefill_size)
