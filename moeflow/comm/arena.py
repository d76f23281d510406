"""Payload arenas: where a mailbox's payload bytes live, apart from its flags, headers and doorbell.

The slot protocol (``mailbox.py``) stays host-side whatever the arena: flags, progress words,
headers and the doorbell are words of the shared segment, stored and polled by the CPU. Only the
payload moves:

- ``host``: the payload area of the segment itself (shared memory), copied synchronously;
- ``cuda_ipc``: one device allocation per mailbox, made by its owner (the reader), whose CUDA-IPC
  handle is published in the segment before it appears; writers map it. Copies run on a
  communication stream (``cudaMemcpyAsync``), so they are complete only once synchronised;
- ``deferred`` (the CPU fake of ``cuda_ipc``): host memory whose copies land only when the
  arena is synchronised, as a stream's do: a protocol step that stores a flag before
  synchronising publishes stale bytes, which the checksummed stress tests then see.

The ordering every arena needs, and which the mailbox keeps in one place: ``Mailbox.set_flag``,
``set_progress`` and ``clear_flag`` call ``arena.release()`` (synchronise every copy issued
through this arena) right before their store. A writer's payload is therefore in place before
its flag says so, and a reader's copy out is finished before its clearing store lets the writer
overwrite the slot.
"""
from __future__ import annotations

import pickle
import struct

import torch

from moeflow.comm.spec import DTYPE_BYTES

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
    def allocate(cls, layout, device: str) -> "PayloadArena":
        """The owner's arena, before its segment exists (``publish`` then ``map`` follow)."""
        return cls()

    def publish(self, buf, layout) -> None:
        """Write what writers need to open the arena into the segment being initialised."""

    def map(self, buf, layout) -> "PayloadArena":
        """Make the slots views (the owner, once the segment exists)."""
        return self

    @classmethod
    def open(cls, buf, layout, device: str) -> "PayloadArena":
        """A writer's arena, from the published segment."""
        return cls.allocate(layout, device).map(buf, layout)

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


@register
class DeferredArena(HostArena):
    """The CPU fake of an asynchronous arena: copies are queued and run at ``release``, in order,
    reading their source then (as a stream does), so a store published before its release
    carries stale bytes. ``num_deferred`` counts the copies that were queued: a test can see
    that the fake actually deferred something."""

    name = "deferred"

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_deferred = 0

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._pending.append((dst, src))
        self.num_deferred += 1

    copy_out = copy_in

    def release(self) -> None:
        for dst, src in self._pending:
            dst.copy_(src)
        self._pending.clear()


@register
class CudaIpcArena(PayloadArena):
    """One device allocation per mailbox, shared through CUDA IPC. The owner allocates it and
    keeps it alive (the mailbox lives as long as its reader); writers open the published handle.
    Copies go on a side stream that first waits for the caller's stream (the source was computed
    there, or the destination is still being read there); ``release`` synchronises that stream."""

    name = "cuda_ipc"
    handle_bytes = 4096
    in_segment = False

    def __init__(self, base: torch.Tensor, layout) -> None:
        super().__init__()
        self.base, self.device = base, base.device
        self.stream = torch.cuda.Stream(device=self.device)
        self._slots = _slot_views(base, layout)
        self._busy = False  # a copy was issued since the last release

    @classmethod
    def allocate(cls, layout, device: str) -> "CudaIpcArena":
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the cuda_ipc payload arena needs a CUDA compute device, got {device!r}")
        return cls(torch.zeros(_elems(layout), dtype=getattr(torch, layout.dtype), device=dev), layout)

    def publish(self, buf, layout) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        blob = pickle.dumps(reduce_tensor(self.base))
        if len(blob) + 8 > self.handle_bytes:
            raise ValueError(f"a CUDA-IPC handle of {len(blob)} bytes does not fit the segment's "
                             f"{self.handle_bytes - 8}")
        off = layout.handle_offset
        buf[off:off + 8 + len(blob)] = struct.pack("<q", len(blob)) + blob

    @classmethod
    def open(cls, buf, layout, device: str) -> "CudaIpcArena":
        off = layout.handle_offset
        (n,) = struct.unpack("<q", bytes(buf[off:off + 8]))
        rebuild, args = pickle.loads(bytes(buf[off + 8:off + 8 + n]))
        return cls(rebuild(*args), layout)

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

    def close(self) -> None:
        self.release()
        super().close()
        self.base = None
