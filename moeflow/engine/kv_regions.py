"""A prefill server's KV held in place for its handoffs (``KvTransferConfig.in_place``): its inner
engine's caches are shared (``EngineConfig.share_kv_cache``), and a finished request's leased
blocks are what it offers. Two ways out of them:

- a decode server on this host reads the table of the server's caches (each attention group's
  ``KvRegion``s) that ``RegionTable`` publishes beside the staging arena in /dev/shm, and its
  members copy the blocks straight into theirs: one copy;
- a decode server elsewhere pulls over the KV link, which sends what ``Gatherer`` collects from
  the members' caches into one buffer laid out as a staged range: the copy the members would have
  made into the arena, made only when someone pulls.
"""
from __future__ import annotations

import os
import pickle
import struct
import threading

import torch

from moeflow.comm.kv_arena import stage_out, staged_views
from moeflow.comm.segment import PREFIX, SHM_DIR, Segment
from moeflow.model.kv_cache import slots_for
from moeflow.workers.kv_transfer import MappedCaches

_LEN = struct.Struct("<q")


def regions_path(arena_path: str) -> str:
    """Where the server owning the arena at ``arena_path`` publishes its table."""
    return arena_path.removesuffix(".kv-arena") + ".kv-regions"


class RegionTable:
    """The prefill side: attention group -> its members' ``KvRegion``s, republished when it changes
    (a worker restarted with a new cache)."""

    def __init__(self, arena_path: str):
        self.path = regions_path(arena_path)
        self._segment: Segment | None = None
        self._table: dict | None = None

    def publish(self, table: dict) -> None:
        if table == self._table:
            return
        blob = pickle.dumps(table)

        def init(buf) -> None:
            _LEN.pack_into(buf, 0, len(blob))
            buf[_LEN.size:_LEN.size + len(blob)] = blob

        old, self._segment = self._segment, Segment.create(self.path, _LEN.size + len(blob), init)
        self._table = table
        if old is not None:  # replaced by the rename: its name is the new segment's now, keep it
            old.is_owner = False
            old.close()

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def read_regions(arena_path: str, group: int) -> tuple | None:
    """A prefill server's group ``group``'s regions on this host, read from its table (None: no
    table there, not one of ours, or no such group). The path comes from a handle: only a moeflow
    segment this user owns is read."""
    path = regions_path(arena_path)
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        return None
    try:
        if os.stat(path).st_uid != os.getuid():
            return None
        seg = Segment.attach(path, lambda buf: len(buf) >= _LEN.size, timeout_s=0.0, writable=False)
    except (OSError, TimeoutError):
        return None
    try:
        (n,) = _LEN.unpack_from(seg.buf, 0)
        table = pickle.loads(bytes(seg.buf[_LEN.size:_LEN.size + n]))
    finally:
        seg.close()
    return table.get(group)


class Gatherer:
    """The prefill side's gather for a pull: a request's blocks out of every member's cache into one
    buffer, whole heads, laid out as a staged range (``comm/kv_arena.py``). Pair threads call it."""

    def __init__(self, num_layers: int, dtype: str, entries):
        self.num_layers, self.dtype, self.entries = num_layers, getattr(torch, dtype), entries
        self.caches = MappedCaches()
        self._lock = threading.Lock()

    def gather(self, regions: tuple, blocks: tuple[int, ...], num_tokens: int, nbytes: int) -> torch.Tensor:
        with self._lock, torch.inference_mode():
            mine = [(self.caches.entries(r), r) for r in regions]
            device = next(iter(mine[0][0].values())).device
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            staged = staged_views(buf, 0, self.num_layers, num_tokens, self.dtype, self.entries)
            for entries, r in mine:
                stage_out(entries, slots_for(blocks, 0, num_tokens, r.block_size, device), staged, r.member)
            return buf

    def close(self) -> None:
        with self._lock:
            self.caches.close()
