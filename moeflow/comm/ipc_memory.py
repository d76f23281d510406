"""Memory one process allocates and others map by a handle published in a shared segment: device
memory by CUDA IPC, or its CPU rehearsal, host memory in a /dev/shm file of its own.

The payload arenas (``arena.py``), the weight store (``cuda_weights.py``) and the KV staging heap
(``kv_arena.py``) all hand their memory to other processes this way. Both kinds keep the rule CUDA
sets: a process cannot open a handle it exported itself (``cudaIpcOpenMemHandle`` refuses it, and
torch 2.11's same-process cache stores the handle under one key and looks it up under another, so
``rebuild_cuda_tensor`` does not catch it). The exporter therefore keeps its own tensor by the
handle's bytes and ``open`` in that process returns it; the rehearsal refuses every other
same-process open as CUDA does, so the CPU suite fails where a GPU would.
"""
from __future__ import annotations

import os
import pickle

import torch

from moeflow.comm.segment import Segment

HOST = "host-ipc"  # the rehearsal's handles: (HOST, path, nbytes, exporter pid)

# this process's exports: the handle's bytes -> (exporting pid, its tensor); a forked child is another process
_OWN: dict[bytes, tuple[int, torch.Tensor]] = {}


class IpcMemory:
    """One allocation and the bytes of its handle; the owner's (``allocate``) or a mapping (``open``)."""

    def __init__(self, tensor: torch.Tensor, handle: bytes, segment: Segment | None, owner: bool):
        self.tensor, self.handle, self._segment, self.owner = tensor, handle, segment, owner

    @classmethod
    def allocate(cls, nbytes: int, device: str, path: str) -> "IpcMemory":
        """``nbytes`` (uint8) on ``device``: a CUDA device's memory, or on the CPU a /dev/shm file at ``path``."""
        dev = torch.device(device)
        if dev.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
            mem = cls(t, pickle.dumps(reduce_tensor(t)), None, True)
        elif dev.type == "cpu":
            seg = Segment.create(path, max(nbytes, 1), lambda buf: None)
            t = torch.frombuffer(seg.buf, dtype=torch.uint8, count=max(nbytes, 1))
            mem = cls(t, pickle.dumps((HOST, path, max(nbytes, 1), os.getpid())), seg, True)
        else:
            raise ValueError(f"memory shared by handle lives on a CUDA device or (the rehearsal) the CPU, got {device!r}")
        _OWN[mem.handle] = (os.getpid(), t)
        return mem

    @classmethod
    def open(cls, handle: bytes) -> "IpcMemory":
        """The allocation ``handle`` names: the exporter's own tensor in its own process, else a mapping."""
        own = _OWN.get(handle)
        if own is not None and own[0] == os.getpid():
            return cls(own[1], handle, None, False)
        obj = pickle.loads(handle)
        if obj[0] != HOST:
            rebuild, args = obj
            return cls(rebuild(*args), handle, None, False)
        _, path, nbytes, pid = obj
        if pid == os.getpid():
            raise RuntimeError(f"{path}: a process cannot open a memory handle it exported itself (as CUDA refuses "
                               f"cudaIpcOpenMemHandle there); the exporter uses its own tensor")
        seg = Segment.attach(path, lambda buf: len(buf) >= nbytes, timeout_s=10.0)
        return cls(torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes), handle, seg, False)

    def close(self) -> None:
        """The owner frees the allocation (peers' mappings stay valid until they close theirs)."""
        if self.owner:
            _OWN.pop(self.handle, None)
        self.tensor = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def exported() -> int:
    """How many allocations this process exports now (a test sees them freed)."""
    return sum(pid == os.getpid() for pid, _ in _OWN.values())
