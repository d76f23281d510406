"""ASAP's scheduler (§3.3): length-aware batches, paired and sent to the first idle DP group.

Pure Python; the engine and the simulator both drive it: ``add`` on arrival, ``schedule(now)``
whenever a group turns idle, a request arrives or ``next_wakeup_s`` passes, ``update`` with each
finished batch, ``release`` when a group has finished its work item. No cross-group balancing:
nothing waits for anything. Decode steps of a group's requests ride in the same work items.
"""
from __future__ import annotations

import abc
import itertools
from collections import deque
from dataclasses import dataclass, field

from moeflow.config import SchedulerConfig
from moeflow.core import Batch, Request, RequestError, RequestStatus, ScheduledSeq
from moeflow.scheduler.batching import BatchFormer, ImmediateBatching, LengthAwareBatching, Proposal
from moeflow.scheduler.block_allocator import BlockAllocator


@dataclass(frozen=True)
class Work:
    """One work item of one DP group: 1 batch, or 2 interleaved layer by layer."""

    group: int
    batches: tuple[Batch, ...]


@dataclass
class _Group:
    allocator: BlockAllocator
    requests: list[Request] = field(default_factory=list)  # admitted here, not finished
    busy: bool = False


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


class AsapScheduler:
    def __init__(self, cfg: SchedulerConfig, allocators: list[BlockAllocator], max_model_len: int,
                 max_num_seqs: int):
        self.cfg = cfg
        self.groups = [_Group(a) for a in allocators]
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.former: BatchFormer = (
            LengthAwareBatching(cfg.min_batch_tokens, cfg.max_batch_tokens, cfg.max_batch_wait_s,
                                cfg.long_prompt_tokens)
            if cfg.length_aware else ImmediateBatching(cfg.max_batch_tokens, cfg.long_prompt_tokens))
        self.pairing: Pairing = DualBatchInterleaving() if cfg.dual_batch else SingleBatch()
        self.group_of: dict[str, int] = {}
        self._batch_ids = itertools.count()

    # -- intake -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        n, total = request.num_prompt_tokens, request.max_total_tokens
        rid = request.request_id
        if n == 0:
            raise RequestError(f"request {rid}: the prompt is empty")
        if total > self.max_model_len:
            raise RequestError(f"request {rid}: prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) "
                               f"= {total} exceeds the model's context of {self.max_model_len} tokens")
        if n > self.cfg.max_batch_tokens:
            raise RequestError(f"request {rid}: prompt of {n} tokens exceeds max_batch_tokens "
                               f"({self.cfg.max_batch_tokens})")
        a = self.groups[0].allocator
        if a.blocks_for(total) > a.num_blocks:
            raise RequestError(f"request {rid}: needs {a.blocks_for(total)} KV blocks, a group holds {a.num_blocks}")
        self.waiting.append(request)

    # -- decisions ----------------------------------------------------------------------------

    def schedule(self, now: float) -> list[Work]:
        works = []
        for gid, g in enumerate(self.groups):
            if g.busy:
                continue
            decode = [r for r in g.requests if not r.is_prefill and r.status == RequestStatus.RUNNING]
            want = self.pairing.max_batches - (1 if decode and self.pairing.max_batches > 1 else 0)

            def fits(reqs: list[Request], g=g) -> bool:
                need = sum(g.allocator.blocks_for(r.max_total_tokens) for r in reqs)
                return need <= g.allocator.num_free and len(g.requests) + len(reqs) <= self.max_num_seqs

            proposals = self.former.propose(self.waiting, now, want, fits) if want else []
            n = self.pairing.take(bool(decode), proposals)
            prefill = [self._admit(gid, p) for p in proposals[:n]]
            batches = self._compose(decode, prefill)
            if batches:
                g.busy = True
                works.append(Work(gid, tuple(batches)))
        return works

    def _admit(self, gid: int, p: Proposal) -> list[Request]:
        g = self.groups[gid]
        for r in p.requests:
            self.waiting.remove(r)
            g.allocator.allocate(r.request_id, r.max_total_tokens)
            r.status = RequestStatus.RUNNING
            g.requests.append(r)
            self.group_of[r.request_id] = gid
        return list(p.requests)

    def _compose(self, decode: list[Request], prefill: list[list[Request]]) -> list[Batch]:
        groups = ([decode] if decode else []) + prefill
        if self.pairing.max_batches == 1 and len(groups) > 1:
            groups = [[r for grp in groups for r in grp]]  # single-batch ablation: one mixed batch
        return [self._batch(reqs) for reqs in groups]

    def _batch(self, reqs: list[Request]) -> Batch:
        seqs = []
        for r in reqs:
            gid = self.group_of[r.request_id]
            start = r.num_computed_tokens
            seqs.append(ScheduledSeq(r.request_id, start, r.num_tokens - start,
                                     self.groups[gid].allocator.table(r.request_id), is_last_chunk=True))
        return Batch(next(self._batch_ids), tuple(seqs))

    def next_wakeup_s(self) -> float | None:
        """When waiting work may become schedulable without any other event (a batch falling due)."""
        return self.former.next_due_s(self.waiting)

    # -- results ------------------------------------------------------------------------------

    def update(self, group: int, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        g = self.groups[group]
        by_id = {r.request_id: r for r in g.requests}
        finished = []
        for s in batch.seqs:
            r = by_id.get(s.request_id)
            if r is None:  # aborted meanwhile
                continue
            r.num_computed_tokens += s.num_tokens
            if r.append_token(sampled[s.request_id]):
                finished.append(r)
        for r in finished:
            self._drop(r)
        return finished

    def release(self, group: int) -> None:
        self.groups[group].busy = False

    def _drop(self, r: Request) -> None:
        gid = self.group_of.pop(r.request_id)
        g = self.groups[gid]
        g.requests.remove(r)
        g.allocator.free(r.request_id)

    def abort(self, request_id: str, reason: str) -> Request | None:
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.status, r.finish_reason = RequestStatus.FINISHED, reason
                return r
        gid = self.group_of.get(request_id)
        if gid is None:
            return None
        r = next(x for x in self.groups[gid].requests if x.request_id == request_id)
        self._drop(r)
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(g.requests for g in self.groups)

    def num_running(self) -> int:
        return sum(len(g.requests) for g in self.groups)
