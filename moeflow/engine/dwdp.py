"""Mode ``dwdp``: N ranks, each the whole model on its own requests; its peers' experts pulled one
layer ahead out of their shared memory. No global step and no all-to-all: a rank that finished
its work item takes its next at once, and no rank waits for another.

A rank that dies fails only its own requests; the others keep serving (their mappings of its
experts stay valid) and nothing new is placed on it. The deployment fails once no rank is left.
"""
from __future__ import annotations

from moeflow.comm import CommConfig
from moeflow.config import ConfigError, EngineConfig
from moeflow.core import Work
from moeflow.engine.base import StepResult, clock, context_len, register_mode
from moeflow.engine.memory import ProcessFootprint, footprints_for
from moeflow.engine.process_engine import ProcessEngine
from moeflow.layout import DwdpLayout
from moeflow.messages import WorkDone
from moeflow.model.footprint import weight_footprint
from moeflow.model.weights import TORCH_DTYPES, load_config
from moeflow.scheduler import make_scheduler
from moeflow.workers.launch import WorkerDied, WorkerHandle

_IDLE_WAIT_S = 0.05  # longest a step blocks when nothing is due


@footprints_for("dwdp")
def _footprints(layout: DwdpLayout, mc, config: EngineConfig):
    """Resident experts, and two layers' worth of pulled ones (the ping-pong slots)."""
    placement = layout.resident(mc.num_experts)
    pulled = [mc.num_experts - len(set(ids)) for ids in placement]
    return layout.max_batch_tokens, lambda fp, block: [
        ProcessFootprint(f"rank{r}", fp.attention_side() + fp.experts(len(ids)),
                         2 * pulled[r] * fp.per_expert // mc.num_moe_layers, block) for r, ids in enumerate(placement)]


@register_mode("dwdp")
class DwdpEngine(ProcessEngine):
    def __init__(self, model_path: str, config: EngineConfig, layout: DwdpLayout):
        super().__init__(config, layout)
        self.model_config, family = load_config(model_path)
        mc = self.model_config
        if not mc.num_moe_layers:
            raise ConfigError("mode 'dwdp' needs a model with MoE layers")
        if config.transport != "shm":
            raise ConfigError(f"mode 'dwdp' pulls experts one-sidedly out of shared memory, not over {config.transport!r}")
        self.placement = layout.resident(mc.num_experts)
        self.max_model_len = context_len(config, mc)
        nnodes = config.cluster.nnodes  # rank r on node r mod N; peers elsewhere serve pulls over gloo
        transport, rank_nodes = self._transport(tuple(r % nnodes for r in range(layout.dp)))
        # weight pulls only: no dispatch/combine buffers
        comm = CommConfig(None, transport, self.deployment_id, rank_nodes=rank_nodes)
        config = self._budget(config, model_path)
        self.scheduler = make_scheduler(layout, config.num_kv_blocks, config.kv_block_size, self.max_model_len,
                                        config.max_num_seqs)
        world = self._world(layout.dp) if transport != "shm" else None
        fp = weight_footprint(model_path, mc, family, TORCH_DTYPES[config.dtype])  # each rank publishes its experts
        self._launch([self._setup(model_path, comm, self.placement, world, "dwdp", r, r, r % nnodes)
                      for r in range(layout.dp)],
                     published_shm_bytes=sum(fp.experts(len(ids)) for r, ids in enumerate(self.placement)
                                             if r % nnodes == 0))
        self.ranks = list(self.deployment.workers)
        self._inflight: dict[int, Work] = {}  # by rank
        self.dead: dict[int, str] = {}  # rank -> why it is gone

    def _alive(self) -> list[WorkerHandle]:
        return [w for i, w in enumerate(self.ranks) if i not in self.dead]

    def step(self) -> StepResult:
        self._check_alive()
        finished = []
        for work in self.scheduler.schedule(clock()):
            try:
                self._run_work(work.group, work.batches, [self.ranks[work.group]])
                self._inflight[work.group] = work
            except WorkerDied as e:
                self._inflight[work.group] = work
                finished += self._rank_died(work.group, str(e))
        result = self._collect()
        result.finished += finished
        return result

    def _collect(self) -> StepResult:
        timeout = _IDLE_WAIT_S if self._inflight or not self.scheduler.has_unfinished() else 0.0
        outputs, finished, busy_s = {}, [], {}
        try:
            got = self.deployment.recv_any([self.ranks[r] for r in self._inflight], timeout, watch=self._alive())
        except WorkerDied as e:
            return StepResult({}, self._rank_died(e.worker.index if e.worker else -1, str(e)))
        for _, msg in got:
            if isinstance(msg, WorkDone):
                busy_s[f"rank{msg.group}"] = sum(t.compute_s for t in msg.timings)
                work = self._inflight.pop(msg.group)
                out = self._attach_timing(msg, work.batches)
                b = work.batches[0]
                finished += self.scheduler.update(msg.group, b, {rid: o.token_id for rid, o in out.items()
                                                                 if o.token_id is not None})
                self.scheduler.release(msg.group)
                outputs.update(out)
        for r in finished:
            self._forget(r.request_id)
        return StepResult(outputs, finished + self._failed_batches(), busy_s)

    def _rank_died(self, rank: int, reason: str) -> list:
        """Fail what ``rank`` held; keep serving on the others (or fail the deployment, if none is left)."""
        if rank < 0 or len(self.dead) + 1 >= len(self.ranks):
            return self._fail(reason).finished
        self.dead[rank] = reason
        group = self.scheduler.pool.groups[rank]
        group.dead, group.busy = True, True
        self.scheduler.placement.exclude(rank)
        self._inflight.pop(rank, None)
        failed = []
        for r in list(group.requests):
            self.scheduler.abort(r.request_id, "error")
            r.error = f"rank {rank} failed: {reason}"
            failed.append(r)
            self._forget(r.request_id)
        return failed

    def memory(self) -> dict[str, dict]:
        """What each rank reported holding at start (bytes by kind)."""
        return {w.name: w.memory for w in self.ranks}

    def _on_fail(self) -> None:
        self._inflight.clear()

    def _busy(self) -> bool:
        return bool(self._inflight)
