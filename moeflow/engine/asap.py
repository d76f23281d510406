"""Mode ``asap``: D·T attention worker processes and E MoE worker processes, no global barrier.

The engine owns the scheduler and the control pipes; hidden states flow between workers through
the one-sided buffers of ``moeflow.comm``. ``step``: schedule -> send work to idle groups -> wait
for any group to finish (or a batch to fall due) -> update.
"""
from __future__ import annotations

import os

from moeflow.comm import CommConfig, CommSpec, WaitPolicy
from moeflow.config import ConfigError, EngineConfig, ParallelConfig, SchedulerConfig
from moeflow.engine.base import StepResult, clock, register_mode
from moeflow.engine.process_engine import ProcessEngine
from moeflow.messages import WorkDone, WorkerSetup
from moeflow.model.sharding import check_tp
from moeflow.model.weights import load_config
from moeflow.scheduler.asap import AsapScheduler, Work
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.workers.launch import WorkerDied, free_port
from moeflow.workers.world import DIST_TRANSPORTS

_IDLE_WAIT_S = 0.05  # longest a step blocks when nothing is due


@register_mode("asap")
class AsapEngine(ProcessEngine):
    def __init__(self, model_path: str, config: EngineConfig, attn_dp: int = 1, attn_tp: int = 1,
                 moe_workers: int = 1, expert_placement=None, pin_cpus: bool = False, transport: str = "shm",
                 scheduler: SchedulerConfig | None = None, recv_thread: bool = True, send_thread: bool = True,
                 wait_policy: WaitPolicy | None = None, trace: bool = False, **scheduler_kwargs):
        super().__init__(config, attn_dp)
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

        allocators = [BlockAllocator(config.num_kv_blocks, config.kv_block_size) for _ in range(attn_dp)]
        self.scheduler = AsapScheduler(scheduler, allocators, self.max_model_len, config.max_num_seqs)
        # MoE workers first: they own the dispatch buffers the attention workers attach to.
        self._launch([setup("moe", e, d + e) for e in range(moe_workers)] +
                     [setup("attention", r, r) for r in range(d)])
        self.attention = [w for w in self.deployment.workers if w.role == "attention"]
        self._inflight: dict[int, Work] = {}  # by group

    def step(self) -> StepResult:
        self._check_alive()
        try:
            for work in self.scheduler.schedule(clock()):
                t = self.parallel.attn_tp
                self._run_work(work.group, work.batches, self.attention[work.group * t:(work.group + 1) * t])
                self._inflight[work.group] = work
            return self._collect()
        except WorkerDied as e:
            return self._fail(str(e))

    def _collect(self) -> StepResult:
        timeout = _IDLE_WAIT_S
        wake = self.scheduler.next_wakeup_s()
        if not self._inflight and wake is not None:
            timeout = min(_IDLE_WAIT_S, max(0.0, wake - clock()))
        leaders = [self.attention[g * self.parallel.attn_tp] for g in self._inflight]
        outputs, finished, busy_s = {}, [], {}
        for _, msg in self.deployment.recv_any(leaders, timeout):
            if isinstance(msg, WorkDone):
                busy_s[f"attention{msg.group}"] = sum(t.compute_s for t in msg.timings)
                work = self._inflight.pop(msg.group)
                out = self._attach_timing(msg, work.batches)
                for b in work.batches:
                    finished += self.scheduler.update(msg.group, b, {s.request_id: out[s.request_id].token_id
                                                                    for s in b.seqs})
                self.scheduler.release(msg.group)
                outputs.update(out)
        for r in finished:
            self._forget(r.request_id)
        return StepResult(outputs, finished, busy_s)

    def _on_fail(self) -> None:
        self._inflight.clear()

    def _busy(self) -> bool:
        return bool(self._inflight)
