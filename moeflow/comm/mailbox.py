"""Mailbox: a shared buffer of lanes x slots, each slot a ready flag, a header and a payload.

One writer per lane (in a dispatch buffer: the writer of lane j of region i; in a combine buffer:
expert rank e), one reader per mailbox (its owner). Legend: L lanes, S slots, W header words,
R rows, H hidden (a mailbox knows nothing of regions: a dispatch buffer's L is ``spec.num_lanes``).

Layout (bytes; every part aligned so that no two writers share a cache line):

    0                 control, 8 int64: magic, version, layout key, owner pid, incarnation
    64                doorbell: one int32 futex word (a line of its own: every writer rings it)
    128               lanes [L, 16] int64, two 64 B lines per lane:
                        word s     flag of slot s: seq of the complete message in it, 0 = empty
                        word 8 + s progress of slot s: seq << 32 | rows written so far
    128 + 128 L       headers [L, S, W'] int64, W' = W rounded up to a 64 B line
    64-aligned        the payload arena's handle, if it has one (``arena.py``; host: none)
    4096-aligned      payload [L, S, R, H] dtype, every slot 4096-aligned (host arena only: other
                      arenas keep the payload elsewhere, e.g. in device memory)

Slot protocol (single producer, single consumer per lane; seq counts a lane's messages from 1):
message ``seq`` goes to slot ``seq % S``. The writer waits until the flag is 0, writes header
and payload, then sets the flag to ``seq``. The reader sees flag == seq, copies header and
payload out, then sets the flag to 0. Each flag word has one writer at a time (the writer owns it
while 0, the reader while non-zero), so no atomic read-modify-write is ever needed; this is why
the T-bit bitmap of ASAP Table 2 (a bit per lane of a region) is stored as a word per lane: Python
cannot OR a bit into a shared word atomically, and a word per writer needs no atomics at all.

Streaming, a refinement for large payloads: the writer writes the payload in chunks and after
each one publishes how many rows are in place (the progress word); a reader with nothing
complete to take copies published rows to private memory meanwhile, so the two copies overlap.
Delivery is unchanged: a message is taken only once its flag is set, and the flag is cleared
only after the whole copy.

Memory ordering. The protocol needs header and payload visible to the reader before the flag
(and the rows below a progress value before that progress store), and the reader's copy finished
before its clearing store. x86-64 is TSO: stores become visible in program order, and loads are
not reordered with older loads or with younger stores, so plain stores in this order suffice.
Two traps: (1) a large memcpy may use non-temporal stores, which are weakly ordered even on x86.
The copies here are ATen's (a vectorized loop of ordinary stores, or glibc's memcpy, which fences
its non-temporal loop with SFENCE before returning), and the flag store comes from Python after
the copy has returned. (2) A flag word is one aligned 8-byte access (memoryview 'q' compiles to a
single mov), so it cannot tear. On a weakly ordered CPU (ARM, POWER) this is not enough: flag and
progress stores must be store-releases (``stlr``, or a ``dmb ish`` before them), the reader's
loads of them load-acquires (``ldar``, or ``dmb ishld`` after them), and the clearing store again
a release; that needs a small C helper (or C++ std::atomic), which Python lacks.
"""
from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass

import torch

from moeflow.comm.arena import ARENAS, PayloadArena
from moeflow.comm.doorbell import FutexDoorbell
from moeflow.comm.segment import Segment, pid_alive
from moeflow.layout.comm_spec import DTYPE_BYTES

MAGIC = 0x316F6C6665656F6D  # b"moeflow1", little-endian
VERSION = 1
_LINE = 64
_PAGE = 4096
_FLAG_WORDS = _LINE // 8  # flag words per lane: S <= 8
_LANE_WORDS = 2 * _FLAG_WORDS  # flags, then progress words


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class MailboxLayout:
    num_lanes: int  # L: writers
    num_slots: int  # S: messages one lane may have unread
    header_words: int  # W: int64 words of one header
    rows: int  # R: payload capacity of one slot, rows of `hidden`
    hidden: int  # H
    dtype: str  # payload element type
    arena: str = "host"  # where the payload lives: a key of arena.ARENAS

    def __post_init__(self) -> None:
        if self.arena not in ARENAS:
            raise ValueError(f"arena must be one of {sorted(ARENAS)}, got {self.arena!r}")
        if not 1 <= self.num_slots <= _FLAG_WORDS:
            raise ValueError(f"num_slots must be in [1, {_FLAG_WORDS}], got {self.num_slots}")
        if min(self.num_lanes, self.header_words, self.rows, self.hidden) < 1:
            raise ValueError(f"every MailboxLayout size must be >= 1: {self}")

    @property
    def bell_offset(self) -> int:
        return _LINE

    @property
    def flags_offset(self) -> int:
        return 2 * _LINE

    @property
    def header_stride(self) -> int:
        return _round_up(8 * self.header_words, _LINE)

    @property
    def headers_offset(self) -> int:
        return self.flags_offset + self.num_lanes * 2 * _LINE

    @property
    def handle_offset(self) -> int:
        return _round_up(self.headers_offset + self.num_lanes * self.num_slots * self.header_stride, _LINE)

    @property
    def payload_offset(self) -> int:
        return _round_up(self.handle_offset + ARENAS[self.arena].handle_bytes, _PAGE)

    @property
    def slot_bytes(self) -> int:
        return _round_up(self.rows * self.hidden * DTYPE_BYTES[self.dtype], _PAGE)

    @property
    def size_bytes(self) -> int:
        """The shared segment's bytes (an arena outside the segment adds none)."""
        payload = self.num_lanes * self.num_slots * self.slot_bytes if ARENAS[self.arena].in_segment else 0
        return self.payload_offset + payload

    @property
    def key(self) -> int:
        """Fingerprint of the geometry: a sender built from another config refuses to attach."""
        return zlib.crc32(repr((VERSION, self.num_lanes, self.num_slots, self.header_words, self.rows,
                                self.hidden, self.dtype, self.arena)).encode())


class Mailbox:
    """A mapped mailbox with its doorbell. The owner reads (and created it); others write."""

    def __init__(self, segment: Segment, layout: MailboxLayout, arena: PayloadArena):
        self.segment, self.layout, self.arena = segment, layout, arena
        self.bell = FutexDoorbell(segment.buf, layout.bell_offset)
        self._raw = memoryview(segment.buf)[:layout.handle_offset]
        self._words = self._raw.cast("q")  # control + flags + headers as int64
        self._flag0 = layout.flags_offset // 8
        self._hdr0, self._hdr_stride = layout.headers_offset // 8, layout.header_stride // 8

    @classmethod
    def create(cls, path: str, layout: MailboxLayout, device: str = "cpu") -> "Mailbox":
        """Create (or atomically replace a stale) mailbox at ``path``; the caller owns and reads it.
        ``device``: where an arena outside the segment allocates the payload."""
        arena = ARENAS[layout.arena].allocate(layout, device, path)

        def init(buf) -> None:
            ctrl = memoryview(buf)[:64].cast("q")
            ctrl[0], ctrl[1], ctrl[2], ctrl[3], ctrl[4] = (MAGIC, VERSION, layout.key, os.getpid(),
                                                           random.getrandbits(63))
            ctrl.release()
            arena.publish(buf, layout)  # before the segment appears: a writer finds it complete

        segment = Segment.create(path, layout.size_bytes, init)
        return cls(segment, layout, arena.map(segment.buf, layout))

    @classmethod
    def attach(cls, path: str, layout: MailboxLayout, timeout_s: float, device: str = "cpu") -> "Mailbox":
        """Attach as a writer once the owner has published a live mailbox of this layout."""

        def accept(buf) -> bool:
            if len(buf) != layout.size_bytes:
                return False
            ctrl = memoryview(buf)[:64].cast("q")
            ok = ctrl[0] == MAGIC and ctrl[1] == VERSION and ctrl[2] == layout.key and pid_alive(ctrl[3])
            ctrl.release()
            return ok

        segment = Segment.attach(path, accept, timeout_s)
        return cls(segment, layout, ARENAS[layout.arena].open(segment.buf, layout, device))

    # --- flags, headers, payload (the hot path: plain index arithmetic, no allocation) ----------

    def flag(self, lane: int, slot: int) -> int:
        return self._words[self._flag0 + lane * _LANE_WORDS + slot]

    def set_flag(self, lane: int, slot: int, seq: int) -> None:
        # NOTE: the release point. Payload and header must be written before this store (TSO keeps
        # program order on x86; see the module docstring for other CPUs; an asynchronous arena's
        # copies are synchronised by its release()).
        self.arena.release()
        self._words[self._flag0 + lane * _LANE_WORDS + slot] = seq

    def clear_flag(self, lane: int, slot: int) -> None:
        # NOTE: only after the payload was copied out: the writer may overwrite it from now on.
        self.arena.release()
        self._words[self._flag0 + lane * _LANE_WORDS + slot] = 0

    def reset_lane(self, lane: int) -> None:
        """Forget ``lane``'s writer (it left an elastic deployment): its flags and progress words back to
        0, so that a writer that joins at its index, numbering from seq 1 again, is not read through
        the old one's words (a progress word left at seq 1 by a streamed first message would let a
        reader copy the old payload's rows as the new message's)."""
        i = self._flag0 + lane * _LANE_WORDS
        for k in range(_LANE_WORDS):
            self._words[i + k] = 0

    def progress(self, lane: int, slot: int, seq: int) -> int:
        """Rows of message ``seq`` already in the slot (0 if the slot holds another message)."""
        p = self._words[self._flag0 + lane * _LANE_WORDS + _FLAG_WORDS + slot]
        return p & 0xFFFFFFFF if p >> 32 == seq else 0

    def set_progress(self, lane: int, slot: int, seq: int, rows: int) -> None:
        # NOTE: a release point like the flag: rows [0, rows) must be written before this store.
        self.arena.release()
        self._words[self._flag0 + lane * _LANE_WORDS + _FLAG_WORDS + slot] = (seq << 32) | rows

    def occupied(self, lane: int) -> int:
        """Slots of ``lane`` holding an unread message."""
        i = self._flag0 + lane * _LANE_WORDS
        return sum(1 for s in range(self.layout.num_slots) if self._words[i + s] != 0)

    def read_header(self, lane: int, slot: int) -> list[int]:
        i = self._hdr0 + (lane * self.layout.num_slots + slot) * self._hdr_stride
        return self._words[i:i + self.layout.header_words].tolist()

    def write_header(self, lane: int, slot: int, words) -> None:
        i = self._hdr0 + (lane * self.layout.num_slots + slot) * self._hdr_stride
        for k, w in enumerate(words):
            self._words[i + k] = w

    def payload(self, lane: int, slot: int) -> torch.Tensor:
        """The slot's payload area, [R, H], in the arena (shared memory for the host arena)."""
        return self.arena.slot(lane, slot)

    @property
    def owner_pid(self) -> int:
        return self._words[3]

    def close(self) -> None:
        """Release the views and the mapping; the owner also unlinks the segment."""
        self.arena.close()
        self._words.release()
        self._raw.release()
        self.bell.close()
        self.segment.close()
