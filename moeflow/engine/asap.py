"""Mode ``asap``: D·T attention worker processes and E MoE worker processes, no global barrier.

The engine owns the scheduler and the control pipes; hidden states flow between workers through
the one-sided buffers of ``moeflow.comm``. ``step``: schedule -> send work to idle groups -> wait
for any group to finish (or a batch to fall due) -> update.
"""
from __future__ import annotations

from moeflow.comm import CommSpec
from moeflow.config import EngineConfig
from moeflow.engine.base import StepResult, clock
from moeflow.engine.eplb import expert_process
from moeflow.engine.memory import ProcessFootprint
from moeflow.engine.process_engine import ProcessEngine
from moeflow.engine.startup import Blueprint
from moeflow.layout import AsapLayout
from moeflow.messages import WorkDone
from moeflow.model.attention import attention_for
from moeflow.model.footprint import kv_bytes_per_token
from moeflow.model.weights import TORCH_DTYPES
from moeflow.workers.launch import WorkerDied



def _spec(layout: AsapLayout, mc, config: EngineConfig) -> CommSpec:
    """A region per DP group, a lane per TP member, an expert rank per MoE worker."""
    held = layout.experts_held(mc.num_experts)
    return CommSpec(num_regions=layout.attn_dp, lanes_per_region=layout.attn_tp, num_expert_ranks=layout.moe_workers,
                    num_experts=mc.num_experts, top_k=mc.num_experts_per_tok, hidden_size=mc.hidden_size,
                    max_batch_tokens=layout.scheduler.max_batch_tokens, dtype=config.dtype,
                    max_local_experts=max(len(ids) for ids in held))


def footprint(layout: AsapLayout, mc, config: EngineConfig):
    spec, held, t = _spec(layout, mc, config), layout.experts_held(mc.num_experts), layout.attn_tp
    member_block = config.kv_block_size * kv_bytes_per_token(attention_for(mc).member_config(t), TORCH_DTYPES[config.dtype])
    return layout.scheduler.max_batch_tokens, lambda fp, block: [
        *(ProcessFootprint(f"attention{r}", fp.attention_side(t), spec.combine_buffer_bytes, member_block)
          for r in range(layout.num_attention_workers)),
        *(ProcessFootprint(*expert_process(layout, config, fp, f"moe{i}", len(held[i])), spec.dispatch_buffer_bytes)
          for i in range(layout.moe_workers))]


class AsapEngine(ProcessEngine):
    mode_name = "asap"

    def __init__(self, model_path: str, config: EngineConfig, layout: AsapLayout):
        super().__init__(config, layout)
        self.attention = self._build(model_path, Blueprint(
            footprint, _spec, ("attention", layout.num_attention_workers), ("moe", layout.moe_workers),
            attn_tp=layout.attn_tp))

    def step(self) -> StepResult:
        self._check_alive()
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
