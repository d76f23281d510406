"""A KV-holding worker's side of the prefill/decode handoff: ``KvSend`` copies a request's blocks
into the staging arena, ``KvRecv`` copies the stage into pre-allocated blocks (or, when the KV is
in place, straight out of the prefill members' caches: the one copy on a host), each then stores
this member's flag (the engine reads it; no reply on the pipe, so an asap group busy with a work
item answers when it gets to the message, and the engine's step never waits for it)."""
from __future__ import annotations

import glob
import logging
import os
import time

import torch

from moeflow.comm.ipc_memory import IpcMemory
from moeflow.comm.kv_arena import READ, WRITE, Entries, KvArena, stage_in, stage_out
from moeflow.comm.kv_pull import copy_by_slices, paired_runs, pull
from moeflow.comm.segment import segment_path
from moeflow.messages import KvRecv, KvRegion, KvSend, KvSource, KvStage
from moeflow.model.attention import attention_for
from moeflow.model.kv_cache import KVCache, carve, slots_for, storage_bytes
from moeflow.model.kv_copy import copy_runs, op_runs

_MAPPED = 64  # prefill members' caches kept mapped (a restarted member's new one replaces the old)

logger = logging.getLogger("moeflow.worker")


class KvTransfers:
    def __init__(self, cache: KVCache, member: int):
        self.cache, self.member = cache, member
        self._arenas: dict[str, KvArena] = {}
        self.caches = MappedCaches()  # prefill members' caches this member read in place
        # the last handle's copy, up to (not including) its flag store: once the flag is stored the
        # engine may see it and go on, so a time taken after it could outlast the engine's own window
        self.last_copy_s = 0.0

    def _arena(self, path: str) -> KvArena:
        if path not in self._arenas:
            self._arenas[path] = KvArena.attach(path)
        return self._arenas[path]

    def handle(self, msg: KvSend | KvRecv) -> None:
        st = msg.stage
        side = WRITE if isinstance(msg, KvSend) else READ
        arena = self._arena(st.arena)
        ok = not st.fail
        t0 = time.perf_counter()
        if ok:
            try:
                if st.source is not None:  # in place: straight out of the prefill members' caches
                    self._pull(st, st.source, msg.block_ids)
                else:
                    staged = arena.views(st.offset_bytes, st.num_layers, st.num_tokens, getattr(torch, st.dtype),
                                         st.entries)
                    slots = slots_for(msg.block_ids, 0, st.num_tokens, self.cache.block_size)
                    if side == WRITE:
                        stage_out(self.cache.entries, slots, staged, self.member)
                    else:
                        stage_in(staged, self.cache.entries, slots, self.member)
                if self.cache.device.type == "cuda":
                    torch.cuda.current_stream(self.cache.device).synchronize()  # the copy, before the flag
            except Exception as e:  # noqa: BLE001  (a failed transfer is that request's, not the worker's)
                logger.warning("KV transfer %d (%s) failed: %s: %s", st.transfer_id,
                               "send" if side == WRITE else "receive", type(e).__name__, e)
                ok = False
        self.last_copy_s = time.perf_counter() - t0
        arena.flags[st.slot, side, self.member] = st.transfer_id if ok else -st.transfer_id

    def _pull(self, st: KvStage, source: KvSource, block_ids: tuple[int, ...]) -> None:
        runs = paired_runs(source.blocks, source.regions[0].block_size, block_ids, self.cache.block_size,
                           st.num_tokens)
        copy = copy_runs if op_runs(self.cache.device) else copy_by_slices
        pull([(self.caches.entries(r), r.member) for r in source.regions], dict(st.entries), self.cache.entries,
             self.member, runs, copy)

    def close(self) -> None:
        for a in self._arenas.values():
            a.close()
        self._arenas.clear()
        self.caches.close()


class MappedCaches:
    """Other processes' KV caches, each mapped once by its region's handle (at most ``_MAPPED``: a
    restarted member's new cache replaces its old one, which is unmapped when it is the oldest)."""

    def __init__(self):
        self._caches: dict[bytes, tuple[IpcMemory, Entries]] = {}

    def entries(self, region: KvRegion) -> Entries:
        got = self._caches.get(region.handle)
        if got is None:
            if len(self._caches) >= _MAPPED:
                self._caches.pop(next(iter(self._caches)))[0].close()
            mem = IpcMemory.open(region.handle)
            entries = carve(mem.tensor, dict(region.entries), region.num_layers, region.num_slots,
                            getattr(torch, region.dtype))
            got = self._caches[region.handle] = (mem, entries)
        return got[1]

    def close(self) -> None:
        for mem, _ in self._caches.values():
            mem.close()
        self._caches.clear()


def own_cache_path(deployment_id: str, what: str) -> str:
    """Where this process's shared cache lives: a name of its own (``what`` and its pid), so that a
    reader holding a predecessor's handle never maps a successor's blocks; a predecessor's file
    (it died: we replace it) is removed first."""
    for stale in glob.glob(segment_path(deployment_id, f"{what}-*")):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    return segment_path(deployment_id, f"{what}-{os.getpid()}")


def shared_cache(cfg, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str, path: str,
                 member: int) -> tuple[KVCache, KvRegion, IpcMemory]:
    """``cfg``'s KV cache carved from memory other processes map (a /dev/shm file at ``path`` on a
    host, CUDA IPC on a device), and the region that names it for the handoff; the caller keeps the
    memory and closes it at exit."""
    return shared_cache_of(attention_for(cfg).kv_layout(), cfg.num_layers, num_blocks, block_size, dtype, device,
                           path, member)


def shared_cache_of(layout, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device | str, path: str, member: int) -> tuple[KVCache, KvRegion, IpcMemory]:
    """``shared_cache`` of a KV layout (entry name -> this member's per-token shape)."""
    layout = dict(layout)
    mem = IpcMemory.allocate(storage_bytes(layout, num_layers, num_blocks * block_size, dtype), str(device), path)
    try:
        cache = KVCache(layout, num_layers, num_blocks, block_size, dtype, storage=mem.tensor)
    except BaseException:
        mem.close()
        raise
    region = KvRegion(mem.handle, num_layers, num_blocks * block_size, block_size, str(dtype).removeprefix("torch."),
                      tuple((n, tuple(s)) for n, s in layout.items()), member)
    return cache, region, mem
