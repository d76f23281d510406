"""Mode ``dep``: the synchronous baselines — N ranks of DP attention + expert parallelism.

A global step schedules a batch for every rank (empty ones run dummy steps), sends them, waits
until *every* rank is done (the straggler effect of ASAP §2), updates; ``step`` returns nothing
while it is out, so a loop driving other engines too keeps turning. With
``chunked_prefill_size`` it is the ChunkedPrefill baseline.
"""
from __future__ import annotations

import time

from moeflow.config import ONE_HOST_SHARED, ConfigError, EngineConfig
from moeflow.engine.base import StepResult, clock
from moeflow.engine.elastic import ElasticExperts
from moeflow.engine.process_engine import ProcessEngine
from moeflow.engine.startup import Blueprint
from moeflow.layout import DepLayout
from moeflow.messages import WorkDone
from moeflow.scheduler import groups
from moeflow.workers.launch import WorkerDied

_IDLE_S = 0.002  # a step with nothing to schedule sleeps this long instead of spinning


class DepEngine(ElasticExperts, ProcessEngine):
    mode_name = "dep"

    def __init__(self, model_path: str, config: EngineConfig, layout: DepLayout):
        super().__init__(config, layout)
        # rank r holds the r-th 1/N of every layer, or what --init-expert-location places there
        # NOTE: a list of its own: the placement's (eplb.attention_workers) takes a joiner at the switch,
        # the global steps from the next boundary on (``_follow_ranks``)
        self.ranks = list(self._build(model_path, Blueprint(("dep", layout.dp))))
        self._out = None  # the global step in flight: (its works, the ranks' answers so far)
        self._elastic()  # --max-dp: ranks join and leave while serving (elastic.py), each an attention group too
        if self.eplb.membership is not None:
            self.eplb.membership.may_begin = self._drained

    def scale(self, ffn: int | None = None, moe: int | None = None, attention: int | None = None,
              ep_size: int | None = None, drain: bool | None = None) -> dict:
        """A dep rank is an attention group and an expert holder at once: ``attention`` and ``ep_size``
        (or SGLang's new_ep_size) name the same ranks. A rank that leaves drains: its requests finish
        there (in the barrier) before its experts move to the others."""
        if attention is not None and ep_size is not None and attention != ep_size:
            raise ConfigError(f"scale: attention={attention} and ep_size={ep_size} disagree (a dep rank is both)")
        if drain is False:
            raise ConfigError("scale dep: a leaving rank's requests finish there (drain); handing them over is "
                              "asap's and afd's")
        return super().scale(ffn=ffn, moe=moe, ep_size=ep_size if ep_size is not None else attention)

    def _drained(self, target: int) -> bool:
        """Whether the change to ``target`` ranks may begin: the leaving ranks admit nothing new from the
        ask on, and their experts move once they hold no request (they keep their place in the
        barrier meanwhile, running empty steps)."""
        pool, leaving = self.scheduler.pool, range(target, len(self.ranks))
        for g in leaving:
            if not pool.groups[g].draining:
                groups.drain(self.scheduler, g)
        return all(groups.settled(pool, g) for g in leaving)

    def _experts_switched(self, n: int) -> None:
        """The placement switched to ``n`` ranks (maybe inside a global step): a joiner is sent the
        switch like every rank; the global steps follow from the next boundary (``_follow_ranks``),
        which is now if none is in flight."""
        super()._experts_switched(n)
        e = self.eplb
        e.attention_workers.extend(e.expert_workers[len(e.attention_workers):])  # admitted just now
        if self._out is None:  # at a boundary now
            self._follow_ranks()

    def _follow_ranks(self) -> None:
        """At a global step boundary: the ranks, and the scheduler's groups, those of the placement."""
        n, ranks = self.layout.dp, self.ranks
        if n > len(ranks):
            for w in self.eplb.expert_workers[len(ranks):n]:
                ranks.append(w)
                groups.add_group(self.scheduler, self.config.num_kv_blocks, self.config.kv_block_size)
                self._known.append(set())
                self._freed.append([])
        elif n < len(ranks):  # drained before the switch (``_drained``): they hold nothing
            groups.remove_last(self.scheduler.pool, len(ranks) - n)
            for w in ranks[n:]:
                self.eplb.attention_workers.remove(w)
            del ranks[n:], self._known[n:], self._freed[n:]

    def _refuse(self) -> None:
        super()._refuse()
        layout, config = self.layout, self.config
        if layout.elastic and config.cluster.is_multinode:
            raise ConfigError("max_dp: dep ranks join on the engine's host only; this deployment spans hosts")
        if layout.tp != 1:
            raise ConfigError(f"dep layout tp={layout.tp}: the engine runs dep ranks of one process (tp 1); "
                              f"tensor-parallel ranks are the simulator's")
        if config.transport not in (*ONE_HOST_SHARED, "dist"):  # dist: a rank's link to itself is a Loopback
            raise ConfigError(f"mode 'dep' runs its all-to-all over shm, cuda-ipc (deferred) or dist, not "
                              f"{config.transport!r}")

    def step(self) -> StepResult:
        """Schedules a global step when none is out; collects its ranks' answers for at most
        ``max_wait_s`` and returns nothing until the last one is in (the barrier holds: no rank gets
        its next batch before then). Not blocking for the whole step lets a loop that drives this
        engine beside others (pd's instances, their KV handoffs) turn meanwhile."""
        self._check_alive()
        if self._out is None:
            self._follow_ranks()
            works = self.scheduler.schedule(clock())
            if not works:
                m = self.eplb.membership
                if m is not None and m.busy and (died := self.eplb.idle()) is not None:  # it goes on, idle
                    return self._fail(died)
                time.sleep(_IDLE_S)
                return StepResult({}, [])
            try:
                for w in works:
                    self._run_work(w.group, w.batches, [self.ranks[w.group]])
            except WorkerDied as e:
                return self._fail(str(e))
            self._out = (works, {})
        return self._collect(self.max_wait_s)

    def _collect(self, wait_s: float) -> StepResult:
        """The global step's answers that arrive within ``wait_s``; its result once the last is in."""
        works, done = self._out
        deadline = clock() + wait_s
        try:
            while len(done) < len(self.ranks):  # the global step boundary: every rank, slowest included
                left = deadline - clock()
                if left <= 0:
                    return StepResult({}, [])
                for _, msg in self._recv_any([w for i, w in enumerate(self.ranks) if i not in done], left):
                    if isinstance(msg, WorkDone):
                        done[msg.group] = msg
        except WorkerDied as e:
            self._out = None
            return self._fail(str(e))
        self._out = None
        result = StepResult({}, [])
        for w in works:
            self._complete(done[w.group], w, result, f"rank{w.group}")
        result.finished += self._failed_batches()
        return result

    def drain(self, timeout_s: float = 120.0) -> None:
        """Collect the global step still out (after its requests were aborted): a step that returned
        before its ranks answered leaves one, and its answers must not reach anyone else."""
        deadline = clock() + timeout_s
        while self._out is not None and self.failed is None:
            if clock() > deadline:
                raise RuntimeError(f"the global step still in flight after {timeout_s:g} s")
            self._collect(max(0.0, deadline - clock()))

    def _busy(self) -> bool:
        return self._out is not None

    def _on_fail(self) -> None:
        super()._on_fail()
        self._out = None
