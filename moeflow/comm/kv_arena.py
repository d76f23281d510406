"""The KV handoff's staging arena: one shared-memory segment between the processes of one host, a
flag table and a byte heap, and the block copies in and out of it.

The heap lives in the segment (host shared memory), or with ``--transport cuda-ipc`` in one device
allocation of the owner whose CUDA-IPC handle the segment carries (``create(..., by_handle=True)``,
``ipc_memory.py``; the rehearsal transport ``deferred`` does the same in host memory): the members
then copy device to device, and only the flags stay host words. Between hosts the heap is
read and filled over gloo, through pinned host staging when it is on a device (``gloo_buffer``).

It knows caches as tensors ``[L, N, *e]`` per entry and positions as slot indices; not requests.
The prefill side's members gather a request's slots of every layer into a range of the heap
(whole heads: a member that holds heads [lo, hi) writes those columns; replicated entries come
from member 0), then store their flag; the decode side's members copy the range into their own
slots (their own heads), then store theirs. The owner (the engine process) allocates ranges and
reads the flags; nobody waits on anybody inside a copy, and no block is pickled.

NOTE: ordering. A flag is stored after the copy into the heap has returned (on a device: after
the member synchronised its stream); x86 is TSO, so a reader that sees the flag sees the payload
(the mailbox relies on the same, ``mailbox.py``).
"""
from __future__ import annotations

import math
import struct

import torch

from moeflow.comm.ipc_memory import IpcMemory
from moeflow.comm.segment import Segment, segment_path

MAX_SLOTS = 1024  # transfers in flight at once (flag-table rows)
MAX_MEMBERS = 16  # TP members per side (flag-table columns)
_ALIGN = 64
_FLAGS_BYTES = MAX_SLOTS * 2 * MAX_MEMBERS * 8  # int64 [slot, side (0 write, 1 read), member]
_HANDLE_BYTES = 4096  # after the flags: the heap's kind, and a handle heap's pickled memory handle
_KIND = struct.Struct("<qq")  # kind, handle length
HANDLE_HEAP = 1  # the kind word; 0 (a fresh segment's zeros): the heap is the segment's own bytes
WRITE, READ = 0, 1

Entries = dict[str, torch.Tensor]  # entry name -> [L, N, *e] one cache's tensor


def arena_path(deployment_id: str) -> str:
    return segment_path(deployment_id, "kv-arena")


class KvArena:
    """A mapped staging arena: ``flags`` [MAX_SLOTS, 2, MAX_MEMBERS] int64 and ``heap`` [bytes] uint8
    (the segment's own bytes after the flags, or an allocation shared by handle)."""

    def __init__(self, segment: Segment, memory: IpcMemory | None = None):
        """``memory``: the owner's handle heap; others open it at first use (one that only reads the
        flags, a decode engine probing a prefill server's arena, never maps the device memory)."""
        self.segment, self._memory = segment, memory
        self._heap = None if memory is None else memory.tensor
        self.flags = torch.frombuffer(segment.buf, dtype=torch.int64, count=_FLAGS_BYTES // 8).view(
            MAX_SLOTS, 2, MAX_MEMBERS)
        self.kind, self._handle_len = _KIND.unpack_from(segment.buf, _FLAGS_BYTES)

    @property
    def heap(self) -> torch.Tensor:
        if self._heap is None and self.kind == HANDLE_HEAP:
            at = _FLAGS_BYTES + _KIND.size
            self._memory = IpcMemory.open(bytes(self.segment.buf[at:at + self._handle_len]))
            self._heap = self._memory.tensor
        elif self._heap is None:
            at = _FLAGS_BYTES + _HANDLE_BYTES
            count = self.segment.size_bytes - at  # 0: flags only (KV read in place, nothing staged)
            self._heap = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=count, offset=at) if count                 else torch.empty(0, dtype=torch.uint8, device="cpu")
        return self._heap

    heap_bytes = property(lambda self: self.heap.numel())

    @classmethod
    def create(cls, path: str, heap_bytes: int, device: str = "cpu", by_handle: bool = False) -> "KvArena":
        """The owner's arena; ``device``: where the heap lives (a CUDA device: shared by CUDA IPC);
        ``by_handle``: a host heap outside the segment, shared as a device one is (the rehearsal)."""
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"a KV staging heap lives in host shared memory or on a CUDA device, got {device!r}")
        memory, blob = None, b""
        if dev.type == "cuda" or by_handle:
            memory = IpcMemory.allocate(heap_bytes, device, f"{path}-heap")
            blob = memory.handle
            if _KIND.size + len(blob) > _HANDLE_BYTES:
                memory.close()
                raise ValueError(f"a memory handle of {len(blob)} bytes does not fit the arena's {_HANDLE_BYTES}")

        def init(buf) -> None:
            if memory is not None:
                _KIND.pack_into(buf, _FLAGS_BYTES, HANDLE_HEAP, len(blob))
                buf[_FLAGS_BYTES + _KIND.size:_FLAGS_BYTES + _KIND.size + len(blob)] = blob

        size = _FLAGS_BYTES + _HANDLE_BYTES + (0 if memory is not None else heap_bytes)
        try:
            return cls(Segment.create(path, size, init), memory)
        except BaseException:
            if memory is not None:
                memory.close()
            raise

    @classmethod
    def attach(cls, path: str, timeout_s: float = 10.0) -> "KvArena":
        return cls(Segment.attach(path, lambda buf: len(buf) >= _FLAGS_BYTES + _HANDLE_BYTES, timeout_s))

    def views(self, offset_bytes: int, num_layers: int, num_tokens: int, dtype: torch.dtype,
              entries: tuple[tuple[str, tuple[int, ...]], ...]) -> Entries:
        """The staged request at ``offset_bytes`` of the heap: one [L, n, *e] view per entry."""
        return staged_views(self.heap, offset_bytes, num_layers, num_tokens, dtype, entries)

    def heap_view(self, offset_bytes: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of the heap at ``offset_bytes`` as a uint8 view [nbytes] (a pull's source or target)."""
        if not 0 <= offset_bytes <= offset_bytes + nbytes <= self.heap_bytes:
            raise ValueError(f"bytes [{offset_bytes}, {offset_bytes + nbytes}) are outside the "
                             f"{self.heap_bytes}-byte heap")
        return self.heap[offset_bytes:offset_bytes + nbytes]

    def close(self) -> None:
        self.flags = self._heap = None
        if self._memory is not None:
            self._memory.close()
        self.segment.close()


def staged_views(buf: torch.Tensor, offset_bytes: int, num_layers: int, num_tokens: int, dtype: torch.dtype,
                 entries) -> Entries:
    """A staged request's layout at ``offset_bytes`` of the uint8 ``buf`` (the heap, or the buffer a
    prefill server gathers a request into for a pull): one [L, n, *e] view per entry."""
    out, off = {}, offset_bytes
    for name, shape in entries:
        count = num_layers * num_tokens * math.prod(shape)
        out[name] = buf[off:off + count * dtype.itemsize].view(dtype).view(num_layers, num_tokens, *shape)
        off += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
    return out


def gloo_buffer(view: torch.Tensor) -> torch.Tensor:
    """What gloo sends from or receives into for ``view``: itself on the host; for a device heap's
    view, a pinned host buffer of its size (the caller copies across)."""
    if view.device.type == "cpu":
        return view
    return torch.empty(view.shape, dtype=view.dtype, device="cpu", pin_memory=True)


def staged_bytes(num_layers: int, num_tokens: int, itemsize: int, entries) -> int:
    """Heap bytes one staged request takes (each entry aligned as ``views`` lays them out)."""
    return sum(-(-num_layers * num_tokens * math.prod(shape) * itemsize // _ALIGN) * _ALIGN for _, shape in entries)


def head_range(whole: tuple[int, ...], mine: tuple[int, ...], member: int) -> tuple[int, int] | None:
    """The heads [lo, hi) of a whole entry that a member's own entry holds; None: it holds it whole
    (replicated: MLA's latent, DSA's indexer keys). Heads split evenly on dim 0 (GQA's K/V)."""
    if tuple(mine) == tuple(whole):
        return None
    if len(mine) != len(whole) or tuple(mine[1:]) != tuple(whole[1:]) or whole[0] % mine[0]:
        raise ValueError(f"a member's KV entry {tuple(mine)} is not an even head split of {tuple(whole)}")
    return member * mine[0], (member + 1) * mine[0]


def stage_out(cache: Entries, slots: torch.Tensor, staged: Entries, member: int) -> None:
    """Copy positions ``slots`` [n] of every layer of ``cache`` into ``staged`` (this member's heads)."""
    for name, src in cache.items():
        dst = staged[name]
        heads = head_range(dst.shape[2:], src.shape[2:], member)
        if heads is None:
            if member == 0:  # replicated on every member: one writes it
                torch.index_select(src, 1, slots.to(src.device), out=dst) if src.device == dst.device else \
                    dst.copy_(src.index_select(1, slots.to(src.device)))
        else:
            dst[:, :, heads[0]:heads[1]].copy_(src.index_select(1, slots.to(src.device)))


def stage_in(staged: Entries, cache: Entries, slots: torch.Tensor, member: int) -> None:
    """Copy ``staged`` (this member's heads of it) into positions ``slots`` [n] of every layer of ``cache``.

    NOTE: a slice copy per run of consecutive slots (a block, or blocks allocated in a row), not
    ``index_copy_``: measured here on 16 MiB of bf16 GQA rows, index_copy_ took 3.8-4.4 ms, the runs
    1.9 ms, a plain memcpy 1.3 ms."""
    runs = slot_runs(slots)
    for name, dst in cache.items():
        src = staged[name]
        heads = head_range(src.shape[2:], dst.shape[2:], member)
        part = src if heads is None else src[:, :, heads[0]:heads[1]]
        for at, first, n in runs:
            dst[:, first:first + n].copy_(part[:, at:at + n])


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """``slots`` [n] as runs of consecutive slots: (position in ``slots``, first slot, length)."""
    s = slots.tolist()
    runs, at = [], 0
    for i in range(1, len(s) + 1):
        if i == len(s) or s[i] != s[i - 1] + 1:
            runs.append((at, s[at], i - at))
            at = i
    return runs


def stage_out_reference(cache: Entries, slots: list[int], staged: Entries, member: int) -> None:
    """The slow oracle of ``stage_out``: position by position, layer by layer."""
    for name, src in cache.items():
        dst = staged[name]
        heads = head_range(dst.shape[2:], src.shape[2:], member)
        if heads is None and member != 0:
            continue
        for layer in range(src.shape[0]):
            for i, s in enumerate(slots):
                if heads is None:
                    dst[layer, i] = src[layer, s]
                else:
                    dst[layer, i, heads[0]:heads[1]] = src[layer, s]


class HeapRanges:
    """First-fit byte ranges of the arena's heap, owned by the engine process (pure bookkeeping)."""

    def __init__(self, size_bytes: int):
        self.size_bytes = size_bytes
        self.used: dict[int, int] = {}  # offset -> length, of the ranges handed out

    def take(self, nbytes: int) -> int | None:
        """An aligned offset with ``nbytes`` free after it, or None while none is."""
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        at = 0
        for off in sorted(self.used):
            if off - at >= nbytes:
                break
            at = off + self.used[off]
        if at + nbytes > self.size_bytes:
            return None
        self.used[at] = nbytes
        return at

    def give(self, offset: int) -> None:
        self.used.pop(offset, None)

    @property
    def used_bytes(self) -> int:
        return sum(self.used.values())
