"""One-sided weight pulls between CUDA processes (DWDP on a GPU; the expert mover's peers).

``CudaIpcWeightStore`` is ``ShmWeightStore``'s sibling: a rank's published tensors live in one
device allocation, and what a peer needs to map it (the CUDA-IPC handle and the tensors' layout)
is published in a small shared-memory segment (``weights<rank>``); a pull is a device-to-device
copy out of the mapped allocation, on whatever stream the puller has made current (the
prefetcher's side stream). The owner keeps the allocation alive as long as its store is open;
a rank that reads its own published tensors gets the owner's (``ipc_memory.py``). On a CPU
compute device it is the rehearsal (transport ``deferred``): the same handles over host memory.
"""
from __future__ import annotations

import math
import pickle
import struct

import torch

from moeflow.comm.ipc_memory import IpcMemory
from moeflow.comm.segment import Segment, segment_path
from moeflow.comm.weights import PeerWeights, WeightStore, pack

_MAGIC = 0x6D6F65666C6F7743  # "moeflowC"
_ALIGN = 256  # bytes: every tensor starts where a vectorised device copy may
_HEAD = struct.Struct("<QQ")  # magic, length of the pickled (handle, layout)


class CudaIpcWeightStore(WeightStore):
    def __init__(self, config, publishers=None):
        super().__init__(config, publishers)
        self._segments: list[Segment] = []
        self._memory: list[IpcMemory] = []  # published allocations (alive while peers may map them), and mappings
        self.device = torch.device(config.compute_device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"the CUDA-IPC weight store needs a CUDA compute device (or the CPU, to rehearse), got "
                             f"{config.compute_device!r}")

    def _path(self, rank: int) -> str:
        return segment_path(self.config.deployment_id, f"weights{rank}")

    def publish(self, rank, tensors):
        layout, offset = pack(tensors, _ALIGN)
        memory = IpcMemory.allocate(offset, str(self.device), f"{self._path(rank)}-heap")
        self._memory.append(memory)
        views = {name: _view(memory.tensor, spec) for name, spec in layout.items()}
        for name, t in tensors.items():
            views[name].copy_(t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every byte in place before a peer can map it
        blob = pickle.dumps((memory.handle, layout))

        def init(buf) -> None:
            _HEAD.pack_into(buf, 0, _MAGIC, len(blob))
            buf[_HEAD.size:_HEAD.size + len(blob)] = blob

        self._segments.append(Segment.create(self._path(rank), _HEAD.size + len(blob), init))
        return views

    def peer(self, rank, timeout_s=None):
        def published(buf) -> bool:
            return len(buf) >= _HEAD.size and _HEAD.unpack_from(buf, 0)[0] == _MAGIC

        seg = Segment.attach(self._path(rank), published, timeout_s or self.config.attach_timeout_s, writable=False)
        self._segments.append(seg)
        n = _HEAD.unpack_from(seg.buf, 0)[1]
        handle, layout = pickle.loads(bytes(seg.buf[_HEAD.size:_HEAD.size + n]))
        memory = IpcMemory.open(handle)
        self._memory.append(memory)
        return PeerWeights({name: _view(memory.tensor, spec) for name, spec in layout.items()})

    def close(self):
        for seg in self._segments:
            seg.close()
        self._segments.clear()
        for m in reversed(self._memory):  # mappings first, then what this store published
            m.close()
        self._memory.clear()


def _view(base: torch.Tensor, spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"])
    nbytes = math.prod(spec["shape"]) * dtype.itemsize
    return base[spec["offset"]:spec["offset"] + nbytes].view(dtype).view(spec["shape"])
