"""Where a decode server reads handed-over KV from, given a prefill server's ``KvHandle``: the
prefill server's staging arena on this host (attached once by path), or its own arena when the
range was pulled from another host; and the handle's range as the KV link names it."""
from __future__ import annotations

from moeflow.comm.kv_arena import KvArena
from moeflow.comm.kv_client import RemoteRange
from moeflow.kv_handle import KvHandle
from moeflow.messages import KvStage


class HandleArenas:
    def __init__(self, own: KvArena):
        self.own = own
        self.attached: dict[str, KvArena] = {}  # prefill servers' arenas on this host, by path

    def by_path(self, path: str) -> KvArena | None:
        """A prefill server's arena on this host (None: not attachable here)."""
        if path not in self.attached:
            try:
                self.attached[path] = KvArena.attach(path, timeout_s=0.0)
            except (OSError, TimeoutError, ValueError):
                return None
        return self.attached[path]

    def of(self, stage: KvStage) -> KvArena | None:
        """Ours (a range pulled from another host), or the prefill server's on this host."""
        return self.own if stage.arena == self.own.segment.path else self.by_path(stage.arena)

    def close(self) -> None:
        for a in self.attached.values():
            a.close()
        self.attached.clear()


def stage_of(h: KvHandle) -> KvStage:
    """The prefill server's staged range as its members' copy message names it."""
    lay = h.layout
    return KvStage(h.arena, h.slot, h.transfer_id, h.offset_bytes, h.num_tokens, lay.num_layers, lay.dtype, lay.entries)


def remote_of(h: KvHandle) -> RemoteRange:
    return RemoteRange(h.server_id, h.host, h.port, h.transfer_id, h.slot, h.offset_bytes, h.nbytes, h.token)
