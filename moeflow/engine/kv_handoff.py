"""The engine's side of the KV connector: the staging arena it owns, the stages it opens for each
handoff, the flags it reads, and what the handoffs cost (the ``/metrics`` series).

A stage is a range of the arena's heap and a row of its flag table. It is reused only once every
member that was sent a copy has stored its flag: a stage abandoned mid-copy (lease expiry, an
abort) drains first, so a late copy never lands in someone else's range.
"""
from __future__ import annotations

import itertools

import torch

from moeflow.comm.kv_arena import MAX_SLOTS, HeapRanges, KvArena, arena_path, staged_bytes
from moeflow.hardware.device import resolve_device
from moeflow.model.attention import attention_for
from moeflow.messages import KvStage
from moeflow.scheduler.handoff.deployment import HandoffStats

BUSY, DONE, FAILED = "busy", "done", "failed"
NO_RANGE = -1  # the offset of a stage that holds no bytes (a row of flags for KV read in place)


def flags_state(arena: KvArena, stage: KvStage, side: int, members: int) -> str:
    """DONE once every member stored its flag in ``arena``, FAILED once all answered and one failed."""
    flags = arena.flags[stage.slot, side, :members].tolist()
    if all(f == stage.transfer_id for f in flags):
        return DONE
    if all(f in (stage.transfer_id, -stage.transfer_id) for f in flags):
        return FAILED
    return BUSY


def heap_device(config) -> tuple[str, bool]:
    """Where a server's staging heap lives, and whether others map it by handle: device memory shared
    by CUDA IPC under ``--transport cuda-ipc`` (the members copy device to device), host memory the
    same way under its rehearsal ``deferred``, else the arena segment's own bytes."""
    if config.transport == "cuda-ipc":
        return resolve_device(config.device), True
    return "cpu", config.transport == "deferred"


class KvConnector:
    def __init__(self, deployment_id: str, heap_bytes: int, num_layers: int, dtype: str,
                 entries: tuple[tuple[str, tuple[int, ...]], ...], heap: tuple[str, bool] = ("cpu", False)):
        """``heap``: its device and whether it is shared by handle (``heap_device``)."""
        self.arena = KvArena.create(arena_path(deployment_id), heap_bytes, *heap)
        self.heap = HeapRanges(heap_bytes)
        self.num_layers, self.dtype, self.entries = num_layers, dtype, entries
        self.itemsize = getattr(torch, dtype).itemsize
        self._slots = list(range(MAX_SLOTS - 1, -1, -1))
        self._ids = itertools.count(1)
        self._draining: list[tuple[KvStage, int, int]] = []  # (stage, side, members) abandoned mid-copy
        self.stats = HandoffStats()

    @classmethod
    def for_model(cls, deployment_id: str, mc, max_model_len: int, dtype: str, buffer_mib: int | None,
                  heap: tuple[str, bool], staged: bool = True) -> "KvConnector":
        """The staging arena of a deployment or server running ``mc``: ``buffer_mib``, or four of its
        longest prompts' KV within [64 MiB, 1 GiB]; not ``staged``: flags only (KV read in place)."""
        entries = tuple(attention_for(mc).kv_layout().items())
        full = staged_bytes(mc.num_layers, max_model_len, getattr(torch, dtype).itemsize, entries)
        heap_bytes = (buffer_mib << 20) if buffer_mib else min(max(4 * full, 64 << 20), 1 << 30)
        heap_bytes = heap_bytes if staged else 0
        return cls(deployment_id, heap_bytes, mc.num_layers, dtype, entries, heap)

    def bytes_for(self, num_tokens: int) -> int:
        return staged_bytes(self.num_layers, num_tokens, self.itemsize, self.entries)

    @property
    def staged(self) -> bool:
        """Whether stages hold copies (False: a heap of 0 bytes, every stage a row of flags for KV
        read in place)."""
        return self.heap.size_bytes > 0

    def open(self, num_tokens: int, staged: bool | None = None) -> KvStage | None:
        """A stage for ``num_tokens`` positions (not ``staged``: a row of flags only, for KV read in
        place), or None while the arena has no room."""
        if not self._slots:
            return None
        staged = self.staged if staged is None else staged
        offset = self.heap.take(self.bytes_for(num_tokens)) if staged else NO_RANGE
        if offset is None:
            return None
        return KvStage(self.arena.segment.path, self._slots.pop(), next(self._ids), offset, num_tokens,
                       self.num_layers, self.dtype, self.entries)

    def status(self, stage: KvStage, side: int, members: int) -> str:
        return flags_state(self.arena, stage, side, members)

    def close(self, stage: KvStage) -> None:
        self.arena.flags[stage.slot].zero_()
        self.heap.give(stage.offset_bytes)
        self._slots.append(stage.slot)

    def abandon(self, stage: KvStage, side: int, members: int) -> None:
        """Give up on a stage whose copies were sent: it is closed once they have all answered."""
        self._draining.append((stage, side, members))
        self.drain()

    def drain(self, gone: bool = False) -> None:
        """Close the abandoned stages whose copies have all answered (``gone``: all of them, their
        processes are no more)."""
        keep = []
        for stage, side, members in self._draining:
            if gone or self.status(stage, side, members) != BUSY:
                self.close(stage)
            else:
                keep.append((stage, side, members))
        self._draining = keep

    @property
    def in_flight(self) -> int:
        return MAX_SLOTS - len(self._slots)

    def shutdown(self) -> None:
        self.arena.close()
