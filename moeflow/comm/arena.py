"""Payload arenas: where a mailbox's payload bytes live, apart from its flags, headers and doorbell.

The slot protocol (``mailbox.py``) stays host-side whatever the arena: flags, progress words,
headers and the doorbell are words of the shared segment, stored and polled by the CPU. Only the
payload moves:

- ``host``: the payload area of the segment itself (shared memory), copied synchronously;
- ``cuda_ipc``: one device allocation per mailbox, made by its owner (the reader), whose CUDA-IPC
  handle is published in the segment before it appears; writers map it (``ipc_memory.py``; the
  owner's own writer uses the owner's tensor: CUDA refuses a same-process open). Copies run on a
  communication stream (``cudaMemcpyAsync``), so they are complete only once synchronised;
- ``deferred`` (the CPU rehearsal of ``cuda_ipc``): the same handle and ownership rules over host
  memory in a /dev/shm file of its own, and copies that land only when the arena is synchronised,
  as a stream's do: a protocol step that stores a flag before synchronising publishes stale
  bytes, and a same-process open that bypasses the owner's tensor is refused, as on a GPU.

The ordering every arena needs, and which the mailbox keeps in one place: ``Mailbox.set_flag``,
``set_progress`` and ``clear_flag`` call ``arena.release()`` (synchronise every copy issued
through this arena) right before their store. A writer's payload is therefore in place before
its flag says so, and a reader's copy out is finished before its clearing store lets the writer
overwrite the slot.
"""
from __future__ import annotations

import struct

import torch

from moeflow.comm.ipc_memory import IpcMemory
from moeflow.layout.comm_spec import DTYPE_BYTES

ARENAS: dict[str, type["PayloadArena"]] = {}


def register(cls):
    ARENAS[cls.name] = cls
    return cls


def _slot_views(base: torch.Tensor, layout) -> list[list[torch.Tensor]]:
    """[L][S] -> [R, H] views of ``base`` (every slot ``layout.slot_bytes`` apart)."""
    base = base.view(layout.num_lanes, layout.num_slots, -1)
    n = layout.rows * layout.hidden
    return [[base[lane, s, :n].view(layout.rows, layout.hidden) for s in range(layout.num_slots)]
            for lane in range(layout.num_lanes)]


def _elems(layout) -> int:
    return layout.num_lanes * layout.num_slots * layout.slot_bytes // DTYPE_BYTES[layout.dtype]


class PayloadArena:
    """The payload slots of one mailbox and the copies into and out of them."""

    name = ""
    handle_bytes = 0  # room in the segment for what a writer opens (a CUDA-IPC handle)
    in_segment = True  # the payload area is part of the shared segment

    def __init__(self) -> None:
        self._slots: list[list[torch.Tensor]] = []

    @classmethod
    def allocate(cls, layout, device: str, path: str) -> "PayloadArena":
        """The owner's arena for the mailbox at ``path``, before its segment exists (``publish``
        then ``map`` follow)."""
        return cls()

    def publish(self, buf, layout) -> None:
        """Write what writers need to open the arena into the segment being initialised."""

    def map(self, buf, layout) -> "PayloadArena":
        """Make the slots views (the owner, once the segment exists)."""
        return self

    @classmethod
    def open(cls, buf, layout, device: str) -> "PayloadArena":
        """A writer's arena, from the published segment."""
        return cls().map(buf, layout)

    def slot(self, lane: int, slot: int) -> torch.Tensor:
        """Slot ``(lane, slot)``'s payload area, [R, H]."""
        return self._slots[lane][slot]

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def release(self) -> None:
        """Right before a release store: every copy issued through this arena is complete."""

    def close(self) -> None:
        self._slots = []


@register
class HostArena(PayloadArena):
    """Today's payloads: the segment's own payload area, plain synchronous copies."""

    name = "host"

    def map(self, buf, layout) -> "HostArena":
        dtype = getattr(torch, layout.dtype)
        self._slots = _slot_views(torch.frombuffer(buf, dtype=dtype, count=_elems(layout),
                                                   offset=layout.payload_offset), layout)
        return self


class IpcArena(PayloadArena):
    """A payload outside the segment, in one allocation of the owner that others map by the handle
    published in the segment (``ipc_memory.py``)."""

    handle_bytes = 4096
    in_segment = False

    def __init__(self, memory: IpcMemory, layout) -> None:
        super().__init__()
        self.memory = memory
        self.base = memory.tensor.view(getattr(torch, layout.dtype))[:_elems(layout)]
        self._slots = _slot_views(self.base, layout)

    @classmethod
    def allocate(cls, layout, device: str, path: str) -> "IpcArena":
        nbytes = _elems(layout) * DTYPE_BYTES[layout.dtype]
        return cls(IpcMemory.allocate(nbytes, cls.memory_device(device), f"{path}-payload"), layout)

    @classmethod
    def memory_device(cls, device: str) -> str:
        return device

    def publish(self, buf, layout) -> None:
        blob = self.memory.handle
        if len(blob) + 8 > self.handle_bytes:
            raise ValueError(f"a memory handle of {len(blob)} bytes does not fit the segment's {self.handle_bytes - 8}")
        off = layout.handle_offset
        buf[off:off + 8 + len(blob)] = struct.pack("<q", len(blob)) + blob

    @classmethod
    def open(cls, buf, layout, device: str) -> "IpcArena":
        off = layout.handle_offset
        (n,) = struct.unpack("<q", bytes(buf[off:off + 8]))
        return cls(IpcMemory.open(bytes(buf[off + 8:off + 8 + n])), layout)

    def close(self) -> None:
        self.release()
        super().close()
        self.base = None
        self.memory.close()


@register
class DeferredArena(IpcArena):
    """The CPU rehearsal of ``cuda_ipc``: host memory shared by handle (same-process opens refused
    as CUDA refuses them), and copies queued and run at ``release``, in order, reading their
    source then (as a stream does), so a store published before its release carries stale bytes.
    ``num_deferred`` counts the copies that were queued: a test can see that the fake actually
    deferred something."""

    name = "deferred"

    def __init__(self, memory: IpcMemory, layout) -> None:
        super().__init__(memory, layout)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_deferred = 0

    @classmethod
    def memory_device(cls, device: str) -> str:
        return "cpu"  # a rehearsal computes on the CPU

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._pending.append((dst, src))
        self.num_deferred += 1

    copy_out = copy_in

    def release(self) -> None:
        for dst, src in self._pending:
            dst.copy_(src)
        self._pending.clear()


@register
class CudaIpcArena(IpcArena):
    """One device allocation per mailbox, shared through CUDA IPC. The owner allocates it and
    keeps it alive (the mailbox lives as long as its reader); writers open the published handle.
    Copies go on a side stream that first waits for the caller's stream (the source was computed
    there, or the destination is still being read there); ``release`` synchronises that stream."""

    name = "cuda_ipc"

    def __init__(self, memory: IpcMemory, layout) -> None:
        super().__init__(memory, layout)
        self.device = self.base.device
        self.stream = torch.cuda.Stream(device=self.device)
        self._busy = False  # a copy was issued since the last release

    @classmethod
    def memory_device(cls, device: str) -> str:
        if torch.device(device).type != "cuda":
            raise ValueError(f"the cuda_ipc payload arena needs a CUDA compute device, got {device!r}")
        return device

    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self._busy = True

    copy_in = copy_out = _issue

    def release(self) -> None:
        if self._busy:
            self.stream.synchronize()
            self._busy = False
