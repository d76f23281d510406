"""Mode ``asap``: D·T attention worker processes and E MoE worker processes, no global barrier.

The engine owns the scheduler and the control pipes; hidden states flow between workers through
the one-sided buffers of ``moeflow.comm``. ``step``: schedule -> send work to idle groups -> wait
for any group to finish (or a batch to fall due) -> update.
"""
from __future__ import annotations

from moeflow.config import EngineConfig
from moeflow.engine.base import StepResult, clock
from moeflow.engine.elastic import ElasticExperts
from moeflow.engine.elastic_attention import AttentionGroups
from moeflow.engine.process_engine import ProcessEngine
from moeflow.engine.startup import Blueprint
from moeflow.layout import AsapLayout
from moeflow.messages import WorkDone
from moeflow.workers.launch import WorkerDied


class AsapEngine(ElasticExperts, ProcessEngine):
    mode_name = "asap"

    def __init__(self, model_path: str, config: EngineConfig, layout: AsapLayout):
        super().__init__(config, layout)
        self.attention = self._build(model_path, Blueprint(
            ("attention", layout.num_attention_workers), ("moe", layout.moe_workers),
            attn_tp=layout.attn_tp))
        # --max-moe-workers, --max-attn-dp: MoE workers, attention groups join and leave while serving
        groups = AttentionGroups(self, layout.attention_capacity, self.scheduler) if layout.max_attn_dp else None
        self._elastic(groups)

    def step(self) -> StepResult:
        self._check_alive()
        if self.attention_groups is not None:
            self.attention_groups.turn()
        try:
            for work in self.scheduler.schedule(clock()):
                t = self.layout.attn_tp
                self._run_work(work.group, work.batches, self.attention[work.group * t:(work.group + 1) * t])
                self._inflight[work.group] = work
            return self._collect()
        except WorkerDied as e:
            return self._fail(str(e))

    def _collect(self) -> StepResult:
        timeout = self.max_wait_s
        wake = self.scheduler.next_wakeup_s()
        if not self._inflight and wake is not None:
            timeout = min(self.max_wait_s, max(0.0, wake - clock()))
        leaders = [self.attention[g * self.layout.attn_tp] for g in self._inflight]
        result = StepResult({}, [])
        for _, msg in self._recv_any(leaders, timeout):
            if isinstance(msg, WorkDone):
                self._complete(msg, self._inflight.pop(msg.group), result, f"attention{msg.group}")
        result.finished += self._failed_batches()
        return result
