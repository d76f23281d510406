"""What every mode with worker processes shares once started: request bookkeeping, failure, traces.

A subclass starts its deployment from a ``Blueprint`` (``startup.py``), then implements ``step``.
Requests live in the scheduler's pool (their one owner in this process); here only ids: which
group holds state for which request, and what each group may forget.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from moeflow.config import EngineConfig
from moeflow.core import Batch, Request, Work
from moeflow.engine.base import EngineLoad, StepResult, clock, validate_request
from moeflow.engine.startup import Startup
from moeflow.layout import Layout
from moeflow.messages import DumpSpans, NewRequest, RunWork, Spans, WorkDone
from moeflow.workers.worker_handle import WorkerDied, WorkerHandle, WorkerStalled, process_state

KV_ROLES = ("attention", "dep", "dwdp", "afd_attention")  # the worker roles that hold a group's KV cache


class ProcessEngine(Startup):
    multinode = True  # every mode with worker processes may place them on several hosts

    def __init__(self, config: EngineConfig, layout: Layout):
        super().__init__(config, layout)
        num_groups = layout.num_groups
        self._known: list[set[str]] = [set() for _ in range(num_groups)]  # requests each group holds state for
        self._freed: list[list[str]] = [[] for _ in range(num_groups)]
        self._work_ids = 0
        self._batch_failures: list[Request] = []  # requests of failed batches, not yet reported
        # per group, when each work item still unanswered was sent, oldest first (the stall watchdog)
        self._issued: dict[int, deque[float]] = {}
        self.stalls = 0  # stalls this deployment noticed (a server counts them)
        self.failed: str | None = None
        self.scheduler = None  # set by the subclass
        # group -> its work item on the workers, for the modes that give a group one at a time
        # (asap, dwdp; dep's global step and afd's steps in flight keep their own)
        self._inflight: dict[int, Work] = {}
        self.expert_load = self.eplb = None  # the modes that spread experts: their load window, placement over time

    # -- intake -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_alive()
        validate_request(request, self.model_config)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id, "abort")
        self._forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        x, e = super().load(), self.expert_load
        if e is None:
            return x
        return dataclasses.replace(x, eplb_physical_experts=e.map.num_slots, eplb_hottest=tuple(e.hottest()),
                                   eplb_balancedness=tuple(zip(e.layer_ids, e.balancedness())))

    def _kv_members(self, group: int) -> int:
        return getattr(self.layout, "attn_tp", 1)

    def _send_kv(self, group: int, message) -> None:
        for w in self._kv_holders(group):
            self.deployment.send(w, message)

    def _kv_holders(self, group: int) -> list:
        t = self._kv_members(group)
        return sorted((w for w in self.deployment.workers if w.role in KV_ROLES and w.index // t == group),
                      key=lambda w: w.index)

    def _kv_regions(self, group: int) -> tuple | None:
        regions = tuple(w.kv_region for w in self._kv_holders(group))
        return None if any(r is None for r in regions) else regions

    # -- work messages ------------------------------------------------------------------------

    def _run_work(self, group: int, batches: tuple[Batch, ...], members: list[WorkerHandle]) -> None:
        """Send one work item to every member of a group (new requests' prompts ride along once)."""
        new = []
        for b in batches:
            for s in b.seqs:
                if s.request_id not in self._known[group]:
                    r = self.scheduler.pool.get(s.request_id)
                    new.append(NewRequest(r.request_id, r.prompt_token_ids, r.params, r.eos_token_ids,
                                          tuple(r.output_token_ids)))
                    self._known[group].add(s.request_id)
        self._work_ids += 1
        msg = RunWork(self._work_ids, batches, new, self._freed[group])
        self._freed[group] = []
        self._issued.setdefault(group, deque()).append(clock())
        if self.eplb is not None:
            self.eplb.issued(self._work_ids)
        for w in members:
            self.deployment.send(w, msg)

    def _recv_any(self, conns: list[WorkerHandle], timeout_s: float,
                  watch: list[WorkerHandle] | None = None) -> list[tuple[WorkerHandle, object]]:
        """``Deployment.recv_any``, then the stall watchdog: raises WorkerStalled once the oldest
        unanswered work item is older than ``stall_timeout_s`` (every mode waits through here)."""
        got = self.deployment.recv_any(conns, timeout_s, watch)
        got = got if self.eplb is None else self.eplb.take(got)
        age, group = self.oldest_work_age_s()
        if age > self.config.stall_timeout_s:
            self.stalls += 1
            local = [w for w in self.deployment.workers if getattr(w.process, "node", None) is None]
            stopped = [f"{w.name} is {'stopped' if s in 'Tt' else 'in uninterruptible sleep'}" for w in local
                       if (s := process_state(w.process.pid)) is not None and s in "TtD"]
            raise WorkerStalled(f"stalled: group {group}'s work item had no answer for {age:.1f} s (stall timeout "
                                f"{self.config.stall_timeout_s:g} s){'; ' if stopped else ''}{'; '.join(stopped)}", group)
        return got

    def oldest_work_age_s(self) -> tuple[float, int | None]:
        """(seconds, group) of the oldest work item without an answer; (0, None) when none is out.
        NOTE: read by a server's scrape thread too: a copy, and a change meanwhile reads as nothing out."""
        try:
            firsts = [(q[0], g) for g, q in list(self._issued.items()) if q]
        except (RuntimeError, IndexError):
            return 0.0, None
        if not firsts:
            return 0.0, None
        t, g = min(firsts)
        return clock() - t, g

    def _complete(self, done: WorkDone, work: Work, result: StepResult, worker: str) -> None:
        """One finished work item, the same way in every mode: ``worker``'s compute time, each live
        request's output with its batch's timing, the scheduler updated batch by batch with the
        sampled tokens, the group released. A request that ended before this item came back (a
        step in flight past its end, an abort) has its output dropped."""
        result.busy_s[worker] = sum(t.compute_s for t in done.timings)
        result.wait_s[worker] = sum(t.wait_s for t in done.timings)
        if self.eplb is not None:
            self.eplb.completed(done)
        live = set(self.scheduler.pool.requests)
        out = self._attach_timing(done, work.batches)
        sampled = {rid: o.token_id for rid, o in out.items() if o.token_id is not None}
        for b in work.batches:
            for r in self.scheduler.update(done.group, b, sampled):
                self._forget(r.request_id)
                result.finished.append(r)
        self.scheduler.release(done.group)
        result.outputs.update({rid: o for rid, o in out.items() if rid in live})

    def _attach_timing(self, done, batches: tuple[Batch, ...]) -> dict:
        """Per request, its output of this work item with its batch's timing (one output for a
        request whose chunks ran in both batches). The requests of a batch that failed on the
        worker end with its error (``_failed_batches``)."""
        issued = self._issued.get(done.group)
        if issued:
            issued.popleft()
        timing = {t.batch_id: t for t in done.timings}
        outputs, failed = {}, set()
        for b in batches:
            if b.batch_id in done.errors:
                failed |= self._fail_batch(done.group, b, done.errors[b.batch_id])
                continue
            for rid, o in done.outputs[b.batch_id].items():
                o.timing = timing[b.batch_id]
                outputs[rid] = outputs[rid].followed_by(o) if rid in outputs else o
        return {rid: o for rid, o in outputs.items() if rid not in failed}

    def _fail_batch(self, group: int, batch: Batch, error: str) -> set[str]:
        """One batch raised on its worker: its requests end with the error, the rest go on."""
        ids = set()
        for s in batch.seqs:
            r = self.scheduler.abort(s.request_id, "error")
            if r is not None:
                r.error = f"batch {batch.batch_id} on group {group} failed: {error}"
                self._batch_failures.append(r)
                self._forget(r.request_id)
                ids.add(r.request_id)
        return ids

    def _failed_batches(self) -> list[Request]:
        """The requests of failed batches since the last call (every mode adds them to its step's finished)."""
        out, self._batch_failures = self._batch_failures, []
        return out

    def _forget(self, request_id: str) -> None:
        for g, known in enumerate(self._known):
            if request_id in known:
                known.discard(request_id)
                self._freed[g].append(request_id)

    # -- failure and shutdown -----------------------------------------------------------------

    def _fail(self, reason: str) -> StepResult:
        """A worker died: every request still here ends with an error, and the deployment stops."""
        self.failed = reason
        self._issued.clear()
        finished = []
        for rid in list(self.scheduler.pool.requests):
            r = self.scheduler.abort(rid, "error")
            if r is not None:
                r.error = reason
                finished.append(r)
        self._on_fail()
        # NOTE: a short grace: the survivors, blocked on the dead worker, never see the Shutdown message
        self.deployment.shutdown(timeout_s=1.0)
        return StepResult({}, finished)

    def drain(self, timeout_s: float = 120.0) -> None:
        """Collect every work item still on a group (``_collect``: a mode that keeps ``_inflight``)."""
        deadline = clock() + timeout_s
        try:
            while self._inflight and self.failed is None:
                if clock() > deadline:
                    raise RuntimeError(f"work items of groups {sorted(self._inflight)} still in flight "
                                       f"after {timeout_s:g} s")
                self._collect()
        except WorkerDied as e:
            self._fail(str(e))

    def member_died(self, group: int, reason: str) -> list[Request]:
        """A caller found a member of ``group`` gone (a send raised ``WorkerDied``): the requests it ended."""
        return self._fail(reason).finished

    def _on_fail(self) -> None:
        """Drop the in-flight bookkeeping (a mode with its own extends this)."""
        self._inflight.clear()

    def check_workers(self) -> StepResult:
        if self.failed is None and self.deployment is not None:
            dead = next((w for w in self.deployment.workers if not w.process.is_alive()), None)
            if dead is not None:
                return self._fail(f"{dead.name} exited unexpectedly (exit code {dead.process.exitcode})")
            if self.eplb is not None and not self._busy() and (died := self.eplb.idle()) is not None:
                return self._fail(died)
        return StepResult({}, [])

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise WorkerDied(f"the {self.mode_name} deployment has failed: {self.failed}")

    def _busy(self) -> bool:
        return bool(self._inflight)

    def collect_spans(self) -> list:
        """Every worker's spans so far (call between requests: work results are not expected here)."""
        if self._busy():
            raise RuntimeError("collect_spans needs an idle deployment")
        spans = []
        for w in self.deployment.workers:
            self.deployment.send(w, DumpSpans())
        pending = list(self.deployment.workers)
        while pending:
            got = self.deployment.recv_any(pending, 5.0)
            for w, msg in got if self.eplb is None else self.eplb.take(got):  # a mover's report is the placement's
                if isinstance(msg, Spans):
                    spans += msg.spans
                    pending.remove(w)
                elif isinstance(msg, WorkDone):  # dropping it here would leave its step waiting for ever
                    raise RuntimeError(f"collect_spans: {w.name} answered work item {msg.work_id}: the "
                                       f"{self.mode_name} deployment was not idle")
        return spans

    def shutdown(self) -> None:
        if self.deployment is not None:
            self.deployment.shutdown()
