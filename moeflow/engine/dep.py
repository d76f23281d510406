"""Mode ``dep``: the synchronous baselines — N ranks of DP attention + expert parallelism.

``step`` is one global step: schedule a batch for every rank (empty ones run dummy steps), send
them, wait until *every* rank is done (the straggler effect of ASAP §2), update. With
``chunked_prefill_size`` it is the ChunkedPrefill baseline.
"""
from __future__ import annotations

import time

from moeflow.comm import CommConfig, CommSpec, WaitPolicy
from moeflow.config import ConfigError, EngineConfig, ParallelConfig
from moeflow.engine.base import StepResult, clock, register_mode
from moeflow.engine.process_engine import ProcessEngine
from moeflow.messages import WorkDone, WorkerSetup
from moeflow.model.weights import load_config
from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.dep import DepScheduler
from moeflow.workers.launch import WorkerDied

_IDLE_S = 0.002  # a step with nothing to schedule sleeps this long instead of spinning


@register_mode("dep")
class DepEngine(ProcessEngine):
    def __init__(self, model_path: str, config: EngineConfig, dp: int = 1, chunked_prefill_size: int | None = None,
                 max_batch_tokens: int = 16384, pin_cpus: bool = False, wait_policy: WaitPolicy | None = None,
                 trace: bool = False, placement: str = "least_loaded"):
        super().__init__(config, dp)
        self.model_config, _ = load_config(model_path)
        mc = self.model_config
        if not mc.num_moe_layers:
            raise ConfigError("mode 'dep' needs a model with MoE layers")
        self.parallel = ParallelConfig(attn_dp=dp, attn_tp=1, moe_workers=dp, pin_cpus=pin_cpus)
        experts = self.parallel.placement(mc.num_experts)  # rank r holds the r-th 1/N of every layer
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.chunked_prefill_size = chunked_prefill_size
        spec = CommSpec(dp, 1, dp, mc.num_experts, mc.num_experts_per_tok, mc.hidden_size, max_batch_tokens,
                        config.dtype, max_local_experts=max(len(ids) for ids in experts))
        comm = CommConfig(spec, "shm", self.deployment_id, wait_policy or WaitPolicy())
        allocators = [BlockAllocator(config.num_kv_blocks, config.kv_block_size) for _ in range(dp)]
        self.scheduler = DepScheduler(allocators, max_batch_tokens, self.max_model_len, config.max_num_seqs,
                                      chunked_prefill_size, placement)
        self._launch([WorkerSetup("dep", r, model_path, config, self.parallel, comm, experts, 0, trace=trace,
                                  cpu=r if pin_cpus else None) for r in range(dp)])
        self.ranks = list(self.deployment.workers)

    def step(self) -> StepResult:
        self._check_alive()
        batches = self.scheduler.schedule(clock())
        if batches is None:
            time.sleep(_IDLE_S)
            return StepResult({}, [])
        try:
            for r, b in enumerate(batches):
                self._run_work(r, (b,), [self.ranks[r]])
            done: dict[int, WorkDone] = {}
            while len(done) < len(self.ranks):  # the global step boundary: every rank, slowest included
                for _, msg in self.deployment.recv_any([w for i, w in enumerate(self.ranks) if i not in done], 0.5):
                    if isinstance(msg, WorkDone):
                        done[msg.group] = msg
        except WorkerDied as e:
            return self._fail(str(e))
        outputs, finished = {}, []
        for r, b in enumerate(batches):
            out = self._attach_timing(done[r], (b,))
            finished += self.scheduler.update(r, b, {rid: o.token_id for rid, o in out.items()
                                                     if o.token_id is not None})
            outputs.update(out)
        for req in finished:
            self._forget(req.request_id)
        busy_s = {f"rank{r}": sum(t.compute_s for t in d.timings) for r, d in done.items()}
        return StepResult(outputs, finished, busy_s)
