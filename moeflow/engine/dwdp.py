"""Mode ``dwdp``: N ranks, each the whole model on its own requests; its peers' experts pulled one
layer ahead out of their shared memory. No global step and no all-to-all: a rank that finished
its work item takes its next at once, and no rank waits for another.

A rank that dies (or stalls: it is killed) fails only its own requests; the others keep serving
(their mappings of its experts stay valid) and nothing new is placed on it: the deployment is
degraded. ``heal`` starts the rank again from its setup (one host): it publishes its experts anew,
maps its peers', and takes requests once it has reported ready, while the others never stopped.
The deployment fails once no rank is left.

With ``max_dp`` ranks join and leave while serving (``elastic_attention.py`` runs the change: a rank
is an attention group). A joiner reads a copy of a starting rank's residents out of that rank's
published segment and pulls what that rank pulls; it publishes nothing, so no peer reads from it and
it may leave once its requests are done (or handed over, with shared KV caches). The starting ranks
hold every expert between them and never leave: they are the floor.
"""
from __future__ import annotations

import dataclasses

from moeflow.comm.segment import SHM_DIR
from moeflow.comm.space import ShmSpaceError, check_room
from moeflow.config import ONE_HOST_SHARED, ConfigError, EngineConfig
from moeflow.engine.base import EngineLoad, StepResult, clock
from moeflow.engine.elastic import ElasticExperts
from moeflow.engine.elastic_attention import AttentionGroups
from moeflow.engine.eplb import start_placement
from moeflow.engine.process_engine import ProcessEngine
from moeflow.engine.startup import Blueprint
from moeflow.layout import DwdpLayout
from moeflow.membership_messages import JoinReplica
from moeflow.messages import WorkDone
from moeflow.model.footprint import weight_footprint
from moeflow.model.weights import TORCH_DTYPES
from moeflow.workers.worker_handle import WorkerDied, WorkerHandle, WorkerStalled



class DwdpEngine(ElasticExperts, ProcessEngine):
    mode_name = "dwdp"

    def __init__(self, model_path: str, config: EngineConfig, layout: DwdpLayout):
        super().__init__(config, layout)
        # weight pulls only (no dispatch/combine buffers); peers on other hosts serve pulls over gloo
        self.ranks = self._build(model_path, Blueprint(("dwdp", layout.dp), computes=False))
        self.attention = self.ranks  # the attention side (AttentionGroups): every rank
        self.dead: dict[int, str] = {}  # rank -> why it is gone (until its replacement is ready)
        self._respawning: dict[int, WorkerHandle] = {}  # rank -> its replacement, not yet ready
        floor = (layout.dp, f"the {layout.dp} ranks the deployment started with hold every expert between them "
                            f"(a rank added later holds a copy of one's)")
        self._elastic(AttentionGroups(self, layout.attention_capacity, self.scheduler, floor) if layout.max_dp else None)

    def scale(self, ffn: int | None = None, moe: int | None = None, attention: int | None = None,
              ep_size: int | None = None, drain: bool | None = None) -> dict:
        """A dwdp rank is an attention group and an expert holder at once: ``attention`` and ``ep_size``
        (SGLang's new_ep_size) name the same ranks."""
        if ffn is not None or moe is not None:
            raise ConfigError(f"scale {'ffn' if ffn is not None else 'moe'}: mode dwdp has none; its ranks scale "
                              f"(ep_size or attention)")
        if attention is not None and ep_size is not None and attention != ep_size:
            raise ConfigError(f"scale: attention={attention} and ep_size={ep_size} disagree (a dwdp rank is both)")
        target = ep_size if ep_size is not None else attention
        if target is not None and self.dead:
            raise ConfigError(f"scale dwdp: {self.load().degraded}; ask again once it is back")
        return super().scale(attention=target, drain=drain)

    def scale_status(self) -> dict:
        out = super().scale_status()
        return out | {"capacity": out.get("attention_capacity", out["capacity"])}

    def _attention_joiner(self, group: int, member: int, world):
        return dataclasses.replace(self._worker_setup("dwdp", group, group, 0),
                                   join=JoinReplica(group % len(self.experts_held)))  # a starting rank's

    def _attention_segments(self) -> list[str]:
        return ["kv-cache-dwdp0-*"]  # a joiner publishes no experts; its KV cache where shared

    def _attention_admitted(self, w) -> None:
        """No placement to send (its experts never move); its residents were read from a peer's segment."""
        self.attention_groups.events[-1].moved_bytes += (w.memory or {}).get("routed_experts", 0)

    def _regions_left(self, regions: list[int]) -> None:
        for r in regions:  # a leaver that died while draining is gone now, not lost
            self.dead.pop(r, None)

    def _refuse(self) -> None:
        super()._refuse()
        if self.config.transport not in ONE_HOST_SHARED:
            raise ConfigError(f"mode 'dwdp' pulls experts one-sidedly out of shared memory, not over "
                              f"{self.config.transport!r}")

    def _place(self, mc, computes: bool):
        start_placement(self.config, self.layout, mc, (), "dwdp", computes=False)  # refuses a starting placement file
        self.experts_held = self.layout.experts_held(mc.num_experts)
        return self.experts_held

    def _shm_bytes(self, model_path: str, family) -> int:
        fp = weight_footprint(model_path, self.model_config, family, TORCH_DTYPES[self.config.dtype])
        self._published = [fp.experts(len(ids)) for ids in self.experts_held]  # each rank's experts in /dev/shm
        nnodes = self.config.cluster.nnodes  # rank r on node r mod N; the room check is this host's
        return sum(b for r, b in enumerate(self._published) if r % nnodes == 0)

    def _alive(self) -> list[WorkerHandle]:
        return [w for i, w in enumerate(self.ranks) if i not in self.dead]

    def step(self) -> StepResult:
        self._check_alive()
        if self.attention_groups is not None:
            self.attention_groups.turn()
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
        if self.attention_groups is not None:
            self.attention_groups.turn()
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
        ag = self.attention_groups
        leaving = set(ag.leaving) if ag is not None else set()  # they go, not come back
        for rank in sorted(set(self.dead) - set(self._respawning) - leaving):
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

