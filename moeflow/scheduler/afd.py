"""AFD's scheduler: every step gives each of the M attention instances m micro-batches.

Per instance the step is dep's (decode first: its running requests' next token or prompt chunk,
then waiting requests placed by the same ``Placement`` policies), cut on request boundaries into
m micro-batches (DBO: one micro-batch's attention runs while the FFN daemons compute another's).
Every instance gets all m, empty ones included: an FFN daemon aggregates the same micro-batch
from each instance it serves, so all of them walk the same (layer, micro-batch) sequence.

Overlap scheduling: step t+1 may be scheduled before step t's results are back. A request then
continues from what its in-flight steps will have computed (``_ahead``) and sampled
(``_samples``); the attention instance, which samples, knows the token. A request that stops on a
stop token in step t still runs in step t+1; its result is dropped (vLLM's async scheduling
does the same). Length limits are known ahead and never overrun.
"""
from __future__ import annotations

from moeflow.core import Batch, Request, ScheduledSeq, Work
from moeflow.scheduler.dep import PLACEMENTS, DepScheduler, Placement
from moeflow.scheduler.pool import RequestPool


def split_micro_batches(pieces: list[tuple[Request, int]], m: int, context: dict[str, int]) -> list[list[tuple[Request, int]]]:
    """``pieces`` (request, tokens) into ``m`` lists, whole requests only, balanced by tokens (the
    FFN's work) and then by context (the attention's): longest first, each to the lightest list.
    Each list keeps the step's order."""
    load = [(0, 0)] * m
    where: dict[int, int] = {}
    for k in sorted(range(len(pieces)), key=lambda k: (-pieces[k][1], -context[pieces[k][0].request_id], k)):
        r, n = pieces[k]
        u = min(range(m), key=lambda u: (load[u], u))
        where[k] = u
        load[u] = (load[u][0] + n, load[u][1] + context[r.request_id])
    return [[p for k, p in enumerate(pieces) if where[k] == u] for u in range(m)]


class AfdScheduler(DepScheduler):
    def __init__(self, pool: RequestPool, placement: Placement, max_batch_tokens: int,
                 chunked_prefill_size: int | None, micro_batches: int):
        super().__init__(pool, placement, max_batch_tokens, chunked_prefill_size)
        self.micro_batches = micro_batches
        self._ahead: dict[str, int] = {}  # tokens of in-flight steps, not yet in num_computed_tokens
        self._samples: dict[str, int] = {}  # tokens in-flight steps will sample

    def _start(self, r: Request) -> int:
        return r.num_computed_tokens + self._ahead.get(r.request_id, 0)

    def _known(self, r: Request) -> int:
        return r.num_tokens + self._samples.get(r.request_id, 0)

    def _step_tokens(self, r: Request) -> int:
        if len(r.output_token_ids) + self._samples.get(r.request_id, 0) >= r.params.max_tokens:
            return 0  # its last token is being sampled already
        left = self._known(r) - self._start(r)
        # NOTE: without chunked prefill a prompt fits a batch (add checks it), but a preempted request's
        # recompute (its prompt and tokens so far) may not: it comes back in max_batch_tokens pieces
        return min(left, self.chunk or self.max_batch_tokens)

    def schedule(self, now: float = 0.0) -> list[Work]:
        """m micro-batches for every live instance, or [] when none has anything to do."""
        live = {i for i, g in enumerate(self.pool.groups) if not g.dead}
        plan = self._plan(live)
        if not any(plan):
            return []
        works = []
        for i in sorted(live):
            context = {r.request_id: self._start(r) for r, _ in plan[i]}
            ubs = split_micro_batches(plan[i], self.micro_batches, context)
            works.append(Work(i, tuple(Batch(next(self._batch_ids), tuple(self._seq(r, n) for r, n in ub))
                                       for ub in ubs)))
        return works

    def _seq(self, r: Request, n: int) -> ScheduledSeq:
        start, rid = self._start(r), r.request_id
        last = start + n == self._known(r)
        self._ahead[rid] = self._ahead.get(rid, 0) + n
        self._samples[rid] = self._samples.get(rid, 0) + last
        return self.pool.seq(r, n, start, last)

    def update(self, group: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        for s in batch.seqs:
            rid = s.request_id
            if rid not in self._ahead:  # finished or aborted while this step ran: its result is dropped
                continue
            self._ahead[rid] -= s.num_tokens
            if s.is_last_chunk:
                self._samples[rid] -= 1
        finished = self.pool.update(group, batch, sampled)
        for r in finished:
            self._ahead.pop(r.request_id, None)
            self._samples.pop(r.request_id, None)
        return finished

    def abort(self, request_id: str, reason: str) -> Request | None:
        self._ahead.pop(request_id, None)
        self._samples.pop(request_id, None)
        return super().abort(request_id, reason)


def build(layout, pool: RequestPool, max_num_batched_tokens: int) -> AfdScheduler:
    return AfdScheduler(pool, PLACEMENTS[layout.placement](len(pool.groups)), layout.max_batch_tokens,
                        layout.chunked_prefill_size, layout.micro_batches)
