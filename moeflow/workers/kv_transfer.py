"""A KV-holding worker's side of the prefill/decode handoff: ``KvSend`` copies a request's blocks
into the staging arena, ``KvRecv`` copies the stage into pre-allocated blocks, each then stores this
member's flag (the engine reads it; no reply on the pipe, so an asap group busy with a work item
answers when it gets to the message, and the engine's step never waits for it)."""
from __future__ import annotations

import logging
import time

import torch

from moeflow.comm.kv_arena import READ, WRITE, KvArena, stage_in, stage_out
from moeflow.messages import KvRecv, KvSend
from moeflow.model.kv_cache import KVCache, slots_for

logger = logging.getLogger("moeflow.worker")


class KvTransfers:
    def __init__(self, cache: KVCache, member: int):
        self.cache, self.member = cache, member
        self._arenas: dict[str, KvArena] = {}
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
                staged = arena.views(st.offset_bytes, st.num_layers, st.num_tokens, getattr(torch, st.dtype),
                                     st.entries)
                slots = slots_for(msg.block_ids, 0, st.num_tokens, self.cache.block_size)
                cache = self.cache.entries
                if side == WRITE:
                    stage_out(cache, slots, staged, self.member)
                else:
                    stage_in(staged, cache, slots, self.member)
                if self.cache.device.type == "cuda":
                    torch.cuda.current_stream(self.cache.device).synchronize()  # the copy, before the flag
            except Exception as e:  # noqa: BLE001  (a failed transfer is that request's, not the worker's)
                logger.warning("KV transfer %d (%s) failed: %s: %s", st.transfer_id,
                               "send" if side == WRITE else "receive", type(e).__name__, e)
                ok = False
        self.last_copy_s = time.perf_counter() - t0
        arena.flags[st.slot, side, self.member] = st.transfer_id if ok else -st.transfer_id

    def close(self) -> None:
        for a in self._arenas.values():
            a.close()
        self._arenas.clear()
