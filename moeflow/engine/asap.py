"""Mode ``asap``: D·T attention worker processes and E MoE worker processes, no global barrier.

The engine owns the scheduler and the control pipes; hidden states flow between workers through
the one-sided buffers of ``moeflow.comm``. ``step``: schedule -> send work to idle groups -> wait
for any group to finish (or a batch to fall due) -> update.
"""
from __future__ import annotations

import os
import uuid

from moeflow.comm import CommConfig, CommSpec, WaitPolicy
from moeflow.config import ConfigError, EngineConfig, ParallelConfig, SchedulerConfig
from moeflow.core import Request
from moeflow.engine.base import Engine, StepResult, clock, register_mode, validate_request
from moeflow.messages import DumpSpans, NewRequest, RunWork, Spans, WorkDone, WorkerSetup
from moeflow.model.sharding import check_tp
from moeflow.model.weights import load_config
from moeflow.scheduler.asap import AsapScheduler, Work
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.workers.launch import Deployment, WorkerDied, free_port
from moeflow.workers.world import DIST_TRANSPORTS

_IDLE_WAIT_S = 0.05  # longest a step blocks when nothing is due


@register_mode("asap")
class AsapEngine(Engine):
    def __init__(self, model_path: str, config: EngineConfig, attn_dp: int = 1, attn_tp: int = 1,
                 moe_workers: int = 1, expert_placement=None, pin_cpus: bool = False, transport: str = "shm",
                 scheduler: SchedulerConfig | None = None, recv_thread: bool = True, send_thread: bool = True,
                 wait_policy: WaitPolicy | None = None, trace: bool = False, **scheduler_kwargs):
        self.config = config
        self.model_config, _ = load_config(model_path)
        mc = self.model_config
        if not mc.num_moe_layers:
            raise ConfigError("mode 'asap' needs a model with MoE layers")
        if scheduler is None:
            scheduler = SchedulerConfig(**scheduler_kwargs)
        elif scheduler_kwargs:
            raise ConfigError(f"pass scheduler options either as scheduler=... or as keywords, not both: "
                              f"{sorted(scheduler_kwargs)}")
        self.parallel = ParallelConfig(attn_dp, attn_tp, moe_workers,
                                       tuple(map(tuple, expert_placement)) if expert_placement else None,
                                       pin_cpus, transport)
        placement = self.parallel.placement(mc.num_experts)
        check_tp(mc, attn_tp)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.deployment_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        spec = CommSpec(attn_dp, attn_tp, moe_workers, mc.num_experts, mc.num_experts_per_tok, mc.hidden_size,
                        scheduler.max_batch_tokens, config.dtype,
                        max_local_experts=max(len(ids) for ids in placement))
        comm = CommConfig(spec, transport, self.deployment_id, wait_policy or WaitPolicy())
        port = free_port() if attn_tp > 1 or transport in DIST_TRANSPORTS else 0
        d = self.parallel.num_attention_workers
        ncpu = os.cpu_count() or 1

        def setup(role: str, index: int, slot: int) -> WorkerSetup:
            return WorkerSetup(role, index, model_path, config, self.parallel, comm, placement, port,
                               recv_thread, send_thread, trace, cpu=slot % ncpu if pin_cpus else None)

        # MoE workers first: they own the dispatch buffers the attention workers attach to.
        setups = [setup("moe", e, d + e) for e in range(moe_workers)] + [setup("attention", r, r) for r in range(d)]
        self.deployment = Deployment(setups, self.deployment_id)
        self.attention = [w for w in self.deployment.workers if w.role == "attention"]
        allocators = [BlockAllocator(config.num_kv_blocks, config.kv_block_size) for _ in range(attn_dp)]
        self.scheduler = AsapScheduler(scheduler, allocators, self.max_model_len, config.max_num_seqs)
        self._requests: dict[str, Request] = {}
        self._known: list[set[str]] = [set() for _ in range(attn_dp)]  # requests each group holds state for
        self._freed: list[list[str]] = [[] for _ in range(attn_dp)]
        self._inflight: dict[int, Work] = {}  # by group
        self._work_ids = 0
        self.failed: str | None = None

    # -- intake -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_alive()
        validate_request(request, self.model_config)
        self.scheduler.add(request)
        self._requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        r = self.scheduler.abort(request_id, "abort")
        self._forget(request_id)
        if r is None:
            self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        self._check_alive()
        try:
            for work in self.scheduler.schedule(clock()):
                self._start(work)
            return self._collect()
        except WorkerDied as e:
            return self._fail(str(e))

    def _start(self, work: Work) -> None:
        g, t = work.group, self.parallel.attn_tp
        new = []
        for b in work.batches:
            for s in b.seqs:
                if s.request_id not in self._known[g]:
                    r = self._requests[s.request_id]
                    new.append(NewRequest(r.request_id, r.prompt_token_ids, r.params))
                    self._known[g].add(s.request_id)
        self._work_ids += 1
        msg = RunWork(self._work_ids, work.batches, new, self._freed[g])
        self._freed[g] = []
        for w in self.attention[g * t:(g + 1) * t]:
            self.deployment.send(w, msg)
        self._inflight[g] = work

    def _collect(self) -> StepResult:
        if not self._inflight:
            wake = self.scheduler.next_wakeup_s()
            timeout = _IDLE_WAIT_S if wake is None else min(_IDLE_WAIT_S, max(0.0, wake - clock()))
        else:
            timeout = _IDLE_WAIT_S
        leaders = [self.attention[g * self.parallel.attn_tp] for g in self._inflight]
        outputs, finished = {}, []
        for _, msg in self.deployment.recv_any(leaders, timeout):
            if isinstance(msg, WorkDone):
                o, f = self._finish(msg)
                outputs.update(o)
                finished += f
        return StepResult(outputs, finished)

    def _finish(self, done: WorkDone):
        work = self._inflight.pop(done.group)
        timing = {t.batch_id: t for t in done.timings}
        outputs, finished = {}, []
        for b in work.batches:
            out = done.outputs[b.batch_id]
            for rid, o in out.items():
                o.timing = timing[b.batch_id]
            outputs.update(out)
            finished += self.scheduler.update(done.group, b, {rid: o.token_id for rid, o in out.items()})
        self.scheduler.release(done.group)
        for r in finished:
            self._forget(r.request_id)
        return outputs, finished

    def _forget(self, request_id: str) -> None:
        for g, known in enumerate(self._known):
            if request_id in known:
                known.discard(request_id)
                self._freed[g].append(request_id)
        self._requests.pop(request_id, None)

    # -- failure and shutdown -----------------------------------------------------------------

    def _fail(self, reason: str) -> StepResult:
        """A worker died: every request still here ends with an error, and the deployment stops."""
        self.failed = reason
        finished = []
        for rid in list(self._requests):
            r = self.scheduler.abort(rid, "error")
            if r is not None:
                r.error = reason
                finished.append(r)
        self._requests.clear()
        self._inflight.clear()
        self.deployment.shutdown()
        return StepResult({}, finished)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise WorkerDied(f"the asap deployment has failed: {self.failed}")

    def collect_spans(self) -> list:
        """Every worker's spans so far (call between requests: work results are not expected here)."""
        if self._inflight:
            raise RuntimeError("collect_spans needs an idle deployment")
        spans = []
        for w in self.deployment.workers:
            self.deployment.send(w, DumpSpans())
        pending = list(self.deployment.workers)
        while pending:
            for w, msg in self.deployment.recv_any(pending, 5.0):
                if isinstance(msg, Spans):
                    spans += msg.spans
                    pending.remove(w)
        return spans

    def shutdown(self) -> None:
        self.deployment.shutdown()

