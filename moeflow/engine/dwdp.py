"""Mode ``dwdp``: N ranks, each the whole model on its own requests; its peers' experts pulled one
layer ahead out of their shared memory. No global step and no all-to-all: a rank that finished
its work item takes its next at once, and no rank waits for another.

A rank that dies (or stalls: it is killed) fails only its own requests; the others keep serving
(their mappings of its experts stay valid) and nothing new is placed on it: the deployment is
degraded. ``heal`` starts the rank again from its setup (one host): it publishes its experts anew,
maps its peers', and takes requests once it has reported ready, while the others never stopped.
The deployment fails once no rank is left.
"""
from __future__ import annotations

import dataclasses

from moeflow.comm import CommConfig
from moeflow.comm.segment import SHM_DIR
from moeflow.comm.space import ShmSpaceError, check_room
from moeflow.config import ONE_HOST_SHARED, ConfigError, EngineConfig
from moeflow.engine.base import EngineLoad, StepResult, clock, context_len
from moeflow.engine.eplb import attach, check_live, start_placement
from moeflow.engine.memory import ProcessFootprint
from moeflow.engine.process_engine import ProcessEngine
from moeflow.layout import DwdpLayout
from moeflow.messages import WorkDone
from moeflow.model.footprint import weight_footprint
from moeflow.model.weights import TORCH_DTYPES, load_config
from moeflow.scheduler import make_scheduler
from moeflow.workers.launch import WorkerDied, WorkerHandle, WorkerStalled



def footprint(layout: DwdpLayout, mc, config: EngineConfig):
    """Resident experts, and two layers' worth of pulled ones (the ping-pong slots)."""
    placement = layout.experts_held(mc.num_experts)
    pulled = [mc.num_experts - len(set(ids)) for ids in placement]
    return layout.max_batch_tokens, lambda fp, block: [
        ProcessFootprint(f"rank{r}", fp.attention_side() + fp.experts(len(ids)),
                         2 * pulled[r] * fp.per_expert // mc.num_moe_layers, block) for r, ids in enumerate(placement)]


class DwdpEngine(ProcessEngine):
    mode_name = "dwdp"

    def __init__(self, model_path: str, config: EngineConfig, layout: DwdpLayout):
        super().__init__(config, layout)
        self.model_config, family = load_config(model_path)
        mc = self.model_config
        if not mc.num_moe_layers:
            raise ConfigError("mode 'dwdp' needs a model with MoE layers")
        if config.transport not in ONE_HOST_SHARED:
            raise ConfigError(f"mode 'dwdp' pulls experts one-sidedly out of shared memory, not over {config.transport!r}")
        check_live(config, "dwdp", computes=False)
        start_placement(config, layout, mc, (), "dwdp", computes=False)  # refuses a starting placement file
        self.experts_held = layout.experts_held(mc.num_experts)
        self.max_model_len = context_len(config, mc)
        nnodes = config.cluster.nnodes  # rank r on node r mod N; peers elsewhere serve pulls over gloo
        transport, rank_nodes = self._transport(tuple(r % nnodes for r in range(layout.dp)))
        # weight pulls only: no dispatch/combine buffers
        comm = CommConfig(None, transport, self.deployment_id, rank_nodes=rank_nodes)
        config = self._budget(config, model_path, footprint)
        self.scheduler = make_scheduler(layout, config, self.max_model_len)
        world = self._world(layout.dp) if transport not in ONE_HOST_SHARED else None
        fp = weight_footprint(model_path, mc, family, TORCH_DTYPES[config.dtype])
        self._published = [fp.experts(len(ids)) for ids in self.experts_held]  # each rank's experts in /dev/shm
        self._launch([self._setup(model_path, comm, self.experts_held, world, "dwdp", r, r, r % nnodes)
                      for r in range(layout.dp)],
                     published_shm_bytes=sum(b for r, b in enumerate(self._published) if r % nnodes == 0))
        self.ranks = list(self.deployment.workers)
        attach(self, mc, self.experts_held, [], [], polls=False, computes=False)
        self.dead: dict[int, str] = {}  # rank -> why it is gone (until its replacement is ready)
        self._respawning: dict[int, WorkerHandle] = {}  # rank -> its replacement, not yet ready

    def _alive(self) -> list[WorkerHandle]:
        return [w for i, w in enumerate(self.ranks) if i not in self.dead]

    def step(self) -> StepResult:
        self._check_alive()
        finished = self._rejoin()
        if self.failed is not None:
            return StepResult({}, finished)
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
        timeout = self.max_wait_s if self._inflight or not self.scheduler.has_unfinished() else 0.0
        result = StepResult({}, [])
        try:
            got = self._recv_any([self.ranks[r] for r in self._inflight], timeout, watch=self._alive())
        except WorkerStalled as e:  # that rank only: it is killed, its requests fail, the others go on
            rank = e.group
            self.ranks[rank].process.kill()
            return StepResult({}, self._rank_died(rank, str(e)))
        except WorkerDied as e:
            return StepResult({}, self._rank_died(e.worker.index if e.worker else -1, str(e)))
        for _, msg in got:
            if isinstance(msg, WorkDone):
                self._complete(msg, self._inflight.pop(msg.group), result, f"rank{msg.group}")
        result.finished += self._failed_batches()
        return result

    def member_died(self, group: int, reason: str) -> list:
        return self._rank_died(group, reason)

    def _rank_died(self, rank: int, reason: str) -> list:
        """Fail what ``rank`` held; keep serving on the others (or fail the deployment, if none is left)."""
        if rank in self.dead:
            return []
        if rank < 0 or len(self.dead) + 1 >= len(self.ranks):
            return self._fail(reason).finished
        self.dead[rank] = reason
        self._inflight.pop(rank, None)
        self._issued.pop(rank, None)
        failed = []
        for r in self.scheduler.lose(rank):
            self.scheduler.abort(r.request_id, "error")
            r.error = f"rank {rank} failed: {reason}"
            failed.append(r)
            self._forget(r.request_id)
        self._known[rank].clear()
        self._freed[rank].clear()  # its replacement knows none of them
        return failed

    def check_workers(self) -> StepResult:
        """A rank that died while idle is lost like one that died in a step; replacements that are
        ready rejoin."""
        if self.failed is not None:
            return StepResult({}, [])
        finished = self._rejoin()
        for rank, w in enumerate(self.ranks):
            if rank not in self.dead and not w.process.is_alive():
                finished += self._rank_died(rank, f"{w.name} exited unexpectedly (exit code {w.process.exitcode})")
        return StepResult({}, finished)

    def load(self) -> EngineLoad:
        x = super().load()
        if not self.dead or self.failed is not None:
            return x
        return dataclasses.replace(x, degraded="; ".join(
            f"rank {r} {'is being replaced' if r in self._respawning else 'is lost'} ({why})"
            for r, why in sorted(self.dead.items())))

    def heal(self) -> bool:
        """Start a replacement for every lost rank; False when one cannot come back in place (its
        host is another, or /dev/shm lacks the room for its experts beside the old copy its peers
        still map)."""
        for rank in sorted(set(self.dead) - set(self._respawning)):
            try:
                check_room(SHM_DIR, self._published[rank], f"a replacement for rank {rank}")
                self._respawning[rank] = self.deployment.respawn(rank)
            except (ValueError, ShmSpaceError) as e:
                self.dead[rank] += f"; cannot be replaced in place: {e}"
                return False
        return True

    def _rejoin(self) -> list:
        """Ranks whose replacement reported ready take requests again; one that failed to start
        fails the deployment (the caller's restart policy decides what next)."""
        for rank, w in list(self._respawning.items()):
            try:
                ready = self.deployment.is_ready(w)
            except WorkerDied as e:
                return self._fail(f"rank {rank} could not be replaced: {e}").finished
            if ready:
                del self._respawning[rank], self.dead[rank]
                self.ranks[rank] = w
                self.scheduler.rejoin(rank)
        return []

    def memory(self) -> dict[str, dict]:
        """What each rank reported holding at start (bytes by kind)."""
        return {w.name: w.memory for w in self.ranks}

