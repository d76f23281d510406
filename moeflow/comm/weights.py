"""One-sided weight pulls (DWDP): a rank publishes named tensors once; its peers copy byte ranges
out of them whenever they like, without the owner doing anything — a stopped or busy owner does
not stop a puller.

``ShmWeightStore``: each rank's tensors live in one shared-memory segment (``weights<rank>``) that
peers map read-only; a pull is a memcpy out of the mapping (the CPU stand-in for a GPU copy
engine reading a peer's memory over NVLink). ``RefWeightStore``: the oracle, one process, plain
tensors. Both read ``tensors[name][index]`` as a flat byte range, so the caller can cut a pull into
slices of any size.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import time
import warnings
from abc import ABC, abstractmethod

import torch

from moeflow.comm.segment import Segment, segment_path

_MAGIC = 0x6D6F65666C6F7757  # "moeflowW"
_ALIGN = 64
_HEAD = struct.Struct("<QQ")  # magic, header length


class PeerWeights(ABC):
    """A peer's published tensors, for reading only."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, index: tuple[int, ...], offset: int, out: torch.Tensor) -> None:
        """Copy bytes [offset, offset + out.numel()) of ``tensors[name][index]`` into ``out`` (uint8)."""
        src = self.tensors[name][index].reshape(-1).view(torch.uint8)  # contiguous: the index picks whole rows
        out.copy_(src[offset:offset + out.numel()])

    def close(self) -> None:
        pass


class WeightStore(ABC):
    def __init__(self, config, publishers: tuple[int, ...] | None = None):
        """``publishers``: the world ranks that publish (None: every rank of the world); a store that
        serves peers on other hosts answers and says goodbye to those alone."""
        self.config, self.publishers = config, publishers

    @abstractmethod
    def publish(self, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Make ``rank``'s tensors readable by its peers; returns the copies the owner computes with."""

    @abstractmethod
    def peer(self, rank: int, timeout_s: float | None = None) -> PeerWeights:
        """``rank``'s published tensors (waits for them to be published)."""

    def close(self) -> None:
        pass


class ShmWeightStore(WeightStore):
    def __init__(self, config, publishers=None):
        super().__init__(config, publishers)
        self._segments: list[Segment] = []

    def _path(self, rank: int) -> str:
        return segment_path(self.config.deployment_id, f"weights{rank}")

    def publish(self, rank, tensors):
        layout, offset = pack(tensors, _ALIGN)
        header = json.dumps({"tensors": layout, "owner_pid": os.getpid()}).encode()
        data0 = -(-(_HEAD.size + len(header)) // _ALIGN) * _ALIGN

        def init(buf: mmap.mmap) -> None:
            _HEAD.pack_into(buf, 0, _MAGIC, len(header))
            buf[_HEAD.size:_HEAD.size + len(header)] = header
            for name, t in tensors.items():
                _view(buf, data0, layout[name]).copy_(t)

        seg = Segment.create(self._path(rank), max(data0 + offset, data0 + 1), init)
        self._segments.append(seg)
        return {name: _view(seg.buf, data0, spec) for name, spec in layout.items()}

    def peer(self, rank, timeout_s=None):
        def published(buf: mmap.mmap) -> bool:
            return len(buf) >= _HEAD.size and _HEAD.unpack_from(buf, 0)[0] == _MAGIC

        seg = Segment.attach(self._path(rank), published, timeout_s or self.config.attach_timeout_s, writable=False)
        self._segments.append(seg)
        n = _HEAD.unpack_from(seg.buf, 0)[1]
        layout = json.loads(bytes(seg.buf[_HEAD.size:_HEAD.size + n]))["tensors"]
        data0 = -(-(_HEAD.size + n) // _ALIGN) * _ALIGN
        with warnings.catch_warnings():  # NOTE: torch warns that a read-only buffer is not writable: we only read
            warnings.simplefilter("ignore", UserWarning)
            return PeerWeights({name: _view(seg.buf, data0, spec) for name, spec in layout.items()})

    def close(self):
        for seg in self._segments:
            seg.close()
        self._segments.clear()


def pack(tensors: dict[str, torch.Tensor], align: int) -> tuple[dict[str, dict], int]:
    """Where each tensor goes in one flat allocation (dtype, shape, byte offset, each ``align``-ed),
    and the bytes it takes."""
    layout, offset = {}, 0
    for name, t in tensors.items():
        offset = -(-offset // align) * align
        layout[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
        offset += t.numel() * t.element_size()
    return layout, offset


def _view(buf: mmap.mmap, data0: int, spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"])
    count = math.prod(spec["shape"])
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=data0 + spec["offset"]).view(spec["shape"])


class RefWeightStore(WeightStore):
    """One process: publishing keeps the tensors; a peer reads them in place."""

    def __init__(self, config, hub=None, publishers=None):
        super().__init__(config, publishers)
        self.hub = {} if hub is None else hub.weights  # the reference transport's hub: one per process

    def publish(self, rank, tensors):
        self.hub[rank] = {name: t.clone() for name, t in tensors.items()}
        return self.hub[rank]

    def peer(self, rank, timeout_s=None):
        deadline = time.monotonic() + (timeout_s or 0.0)
        while rank not in self.hub:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {rank} has published no weights")
            time.sleep(1e-3)
        return PeerWeights(self.hub[rank])
