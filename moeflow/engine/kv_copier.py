"""A handoff side's copies through its engine: ``KvSend`` to the members holding a prefill group's
blocks (they copy into the stage), ``KvRecv`` to a decode group's (they copy the stage into the
reserved blocks); each member stores its flag in the stage's arena when done, and ``status``
reads them. Nobody waits inside a copy.

When the prefill group's caches are shared (``KvPort.regions``) nothing is copied out: the stage
names the leased blocks in place (``KvStage.source``) and the decode members copy from there, one
copy instead of two; the stage is then only a row of flags.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

from moeflow.comm.kv_arena import READ, WRITE, KvArena
from moeflow.engine.kv_handoff import DONE, KvConnector, flags_state
from moeflow.messages import KvRecv, KvSend, KvSource, KvStage
from moeflow.scheduler.handoff.port import KvPort


class EngineCopier:
    def __init__(self, kv: KvConnector, port: KvPort, fail_prob: float = 0.0, rng: random.Random | None = None,
                 arena_of: Callable[[KvStage], KvArena] | None = None):
        """``fail_prob``: a copy reports failure on purpose with this probability (``MOEFLOW_PD_FAIL_PROB``,
        drawn from ``rng``, which a deployment's copiers share); ``arena_of``: the arena a stage lives in
        (a decode server reads a prefill server's; default: ours)."""
        self.kv, self.port = kv, port
        self._fail_prob, self._rng = fail_prob, rng or random.Random(0)
        self.arena_of = arena_of or (lambda stage: kv.arena)

    def _maybe_fail(self, stage: KvStage) -> KvStage:
        if self._fail_prob and self._rng.random() < self._fail_prob:
            return dataclasses.replace(stage, fail=True)
        return stage

    def copy_out(self, group: int, stage: KvStage, blocks: tuple[int, ...]) -> tuple[KvStage, bool]:
        regions = self.port.regions(group)
        if regions is not None:
            return dataclasses.replace(stage, source=KvSource(regions, tuple(blocks))), True
        self.port.send(group, KvSend(self._maybe_fail(stage), blocks))
        return stage, False

    def copy_in(self, group: int, stage: KvStage, blocks: tuple[int, ...]) -> None:
        self.arena_of(stage).flags[stage.slot, READ].zero_()
        self.port.send(group, KvRecv(self._maybe_fail(stage), blocks))

    def status(self, stage: KvStage, side: int, group: int) -> str:
        """``kv_handoff.DONE`` once every member of ``group`` stored its flag, ``FAILED`` once all
        answered and one failed, else ``BUSY``."""
        if side == WRITE and stage.source is not None:
            return DONE  # nothing was copied out: the KV is read where it is
        return flags_state(self.arena_of(stage), stage, side, self.port.members(group))

    def abandon(self, stage: KvStage, side: int, group: int) -> None:
        if side == WRITE and stage.source is not None:
            return self.kv.close(stage)  # no copy was sent: nobody will answer
        self.kv.abandon(stage, side, self.port.members(group))

