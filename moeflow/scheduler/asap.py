"""ASAP's scheduler (§3.3): length-aware batches, paired and sent to the first idle DP group.

Pure Python; the engine and the simulator both drive it: ``add`` on arrival, ``schedule(now)``
whenever a group turns idle, a request arrives or ``next_wakeup_s`` passes, ``update`` with each
finished batch, ``release`` when a group has finished its work item. No cross-group balancing:
nothing waits for anything. Decode steps of a group's requests ride in the same work items.
The policies are objects passed in (``from_config`` builds them from the layout's switches):
how batches form (``BatchFormer``), how many a group takes (``Pairing``), and whether a lone
batch is cut in two (``LoneBatchSplit``).
"""
from __future__ import annotations

import abc
import itertools

from moeflow.config import SchedulerConfig
from moeflow.core import Batch, Request, Work
from moeflow.scheduler.batching import BatchFormer, ImmediateBatching, LengthAwareBatching, Proposal
from moeflow.scheduler.pool import RequestPool, Scheduler


class Pairing(abc.ABC):
    """How many prefill proposals an idle group takes, given whether it has decode work."""

    @abc.abstractmethod
    def take(self, has_decode: bool, proposals: list[Proposal]) -> int: ...

    @property
    @abc.abstractmethod
    def max_batches(self) -> int: ...


class DualBatchInterleaving(Pairing):
    """ASAP §3.3.2: co-schedule two batches; a lone batch waits for a partner unless it is due or long."""

    max_batches = 2

    def take(self, has_decode, proposals):
        if not proposals:
            return 0
        if has_decode or proposals[0].is_long:
            return 1  # decode work is the partner; a long prompt runs without a prefill partner
        if len(proposals) >= 2 and not proposals[1].is_long:
            return 2
        return 1 if proposals[0].is_due else 0


class SingleBatch(Pairing):
    """Ablation: one batch per group at a time (decode rows merged into it)."""

    max_batches = 1

    def take(self, has_decode, proposals):
        return min(1, len(proposals))


class LoneBatchSplit:
    """moeflow's addition to ASAP: a lone prefill batch (no partner, no decode rows) of at least
    ``min_tokens`` is cut at its token midpoint into two micro-batches that interleave like a pair."""

    def __init__(self, min_tokens: int):
        self.min_tokens = min_tokens

    def applies(self, pieces: list[tuple[Request, int, int]]) -> bool:
        return sum(n for _, _, n in pieces) >= self.min_tokens


class AsapScheduler(Scheduler):
    def __init__(self, pool: RequestPool, former: BatchFormer, pairing: Pairing, max_batch_tokens: int,
                 split: LoneBatchSplit | None = None):
        super().__init__(pool)
        self.former, self.pairing, self.split = former, pairing, split
        self.max_batch_tokens = max_batch_tokens
        self._batch_ids = itertools.count()

    @classmethod
    def from_config(cls, pool: RequestPool, cfg: SchedulerConfig) -> "AsapScheduler":
        former: BatchFormer = (
            LengthAwareBatching(cfg.min_batch_tokens, cfg.max_batch_tokens, cfg.max_batch_wait_s,
                                cfg.long_prompt_tokens)
            if cfg.length_aware else ImmediateBatching(cfg.max_batch_tokens, cfg.long_prompt_tokens))
        pairing = DualBatchInterleaving() if cfg.dual_batch else SingleBatch()
        split = LoneBatchSplit(cfg.min_split_tokens) if cfg.dual_batch and cfg.split_lone_batch else None
        return cls(pool, former, pairing, cfg.max_batch_tokens, split)

    def add(self, request: Request) -> None:
        self.pool.check(request, self.max_batch_tokens)
        self.pool.enqueue(request)

    def schedule(self, now: float) -> list[Work]:
        pool, works = self.pool, []
        for gid, g in enumerate(pool.groups):
            if g.busy:
                continue
            decode = []  # a prompt is done within one work item; oldest first, make_room may preempt the newest
            for r in [r for r in g.requests if not r.is_prefill]:
                if r in g.requests and pool.make_room(r, r.num_computed_tokens + 1, {d.request_id for d in decode}):
                    decode.append(r)
            want = self.pairing.max_batches - (1 if decode and self.pairing.max_batches > 1 else 0)
            proposals = self.former.propose(pool.waiting, now, want, lambda reqs, gid=gid: pool.room_for(gid, reqs)) \
                if want else []
            prefill = []
            for p in proposals[:self.pairing.take(bool(decode), proposals)]:
                for r in p.requests:
                    pool.admit(gid, r)
                prefill.append(list(p.requests))
            batches = self._compose(decode, prefill)
            if batches:
                g.busy = True
                works.append(Work(gid, tuple(batches)))
        return works

    def _compose(self, decode: list[Request], prefill: list[list[Request]]) -> list[Batch]:
        pieces = [[(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens) for r in reqs]
                  for reqs in ([decode] if decode else []) + prefill]
        if self.pairing.max_batches == 1 and len(pieces) > 1:
            pieces = [[x for p in pieces for x in p]]  # single-batch ablation: one mixed batch
        elif self.split is not None and len(pieces) == 1 and not decode and self.split.applies(pieces[0]):
            pieces = _halve(pieces[0])
        return [Batch(next(self._batch_ids), tuple(self.pool.seq(r, n, start) for r, start, n in p)) for p in pieces]

    def next_wakeup_s(self) -> float | None:
        return self.former.next_due_s(self.pool.waiting)


def _halve(pieces: list[tuple[Request, int, int]]) -> list[list[tuple[Request, int, int]]]:
    """Cut (request, start, tokens) pieces at the token midpoint; a request across it is split in two
    chunks, the first in the first half (which each layer computes first); the engine gives such a
    request one output (``messages.SeqOutput.followed_by``)."""
    half = sum(n for _, _, n in pieces) // 2
    first, second, acc = [], [], 0
    for r, start, n in pieces:
        if acc >= half:
            second.append((r, start, n))
        elif acc + n <= half:
            first.append((r, start, n))
            acc += n
        else:
            k = half - acc
            first.append((r, start, k))
            second.append((r, start + k, n - k))
            acc = half
    return [first, second]


def build(layout, pool: RequestPool, max_num_batched_tokens: int) -> AsapScheduler:
    return AsapScheduler.from_config(pool, layout.scheduler)
