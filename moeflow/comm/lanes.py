"""Lanes over torch.distributed links: the message slots ``dist.py`` and ``links.py`` send and receive.

The receiver plays the shared buffer's part with pre-posted receives: every lane has ``num_slots``
private receive buffers with an ``irecv`` posted on each, so a sender's ``isend`` lands without the
receiver's involvement, and the send returns after staging its copy (pinned when the payloads are
a GPU's). A message is one uint8 tensor: header [seq, *words] int64 (padded to 64 B), then the
payload bytes; gloo accepts a receive buffer larger than the message, so slots are posted whole.

Message ``seq`` of a lane uses slot ``seq % num_slots`` and tag ``base + slot`` on both sides. A
sender reuses a staging slot once its previous isend completed (else it waits: backpressure);
a receiver re-posts a slot once it copied the message out.

A *link* carries one peer's lanes: ``WorldLink`` a rank of the process's world (the default group),
``PairLink`` a group of just the two processes (``pair_link.py``: a member that joins later meets
its peers there). A link may form after the lane is opened: receives are posted once it has, and a
send waits for it. A lane from a process to itself (dep's ``shared_ranks``) is a ``Loopback`` in
process memory: gloo cannot send to its own rank.

NOTE: gloo marks a work completed only for a thread that waits on it (``get_future`` is not
implemented), so one ``Completer`` thread per peer waits on that peer's works in order, the GIL
released. With NCCL (``device="cuda"``, untested here) ``wait()`` only orders a stream: it syncs too.

Closing is collective: every process closes its senders (goodbye headers fill the peers' posted
receives), then its receivers (which wait for those goodbyes). One lane may also close alone
(``LaneSender.goodbye``, ``LaneReceiver.drop``): its peer left an elastic deployment.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from moeflow.comm.completer import Completer
from moeflow.comm.doorbell import Doorbell, EventDoorbell
from moeflow.comm.loopback import loopback
from moeflow.comm.message import ProtocolError, SendStats
from moeflow.comm.wait import POLICIES, wait_for


class WorldLink:
    """A peer that is a rank of this process's world: formed from the start."""

    formed = True

    def __init__(self, rank: int):
        self.rank = rank

    def isend(self, buf: torch.Tensor, tag: int):
        return dist.isend(buf, self.rank, tag=tag)

    def irecv(self, buf: torch.Tensor, tag: int):
        return dist.irecv(buf, self.rank, tag=tag)

    def when_ready(self, fn: Callable[[], None]) -> None:
        fn()


def header_bytes(header_words: int) -> int:
    return (8 * (1 + header_words) + 63) // 64 * 64


def _staging(config, size: int) -> torch.Tensor:  # pinned when gloo carries a GPU's payloads: one DMA each
    return torch.empty(size, dtype=torch.uint8, device=config.device,
                       pin_memory=config.device == "cpu" and config.compute_device.startswith("cuda"))


def _world_links(peers: list[int]) -> tuple[Callable[[int], object], set[int]]:
    """(link of a world rank, the lanes to this process itself) for ``peers`` of the world."""
    me = dist.get_rank()
    return WorldLink, {i for i, p in enumerate(peers) if p == me}


class LaneSender:
    """One lane's messages to several peers: staging slots and isends per peer, set up at the first
    message to each. ``link_of(world rank)``: how to reach a peer (default: the world)."""

    def __init__(self, config, peers: list[int], tag: int, header_words: int, rows: int, stats: SendStats,
                 link_of: Callable[[int], object] | None = None):
        spec = config.spec
        self.config, self.peers, self.tag, self.policy, self.stats = config, peers, tag, config.wait, stats
        self.num_slots, self.hidden, self.dtype = spec.num_slots, spec.hidden_size, getattr(torch, spec.dtype)
        self.row_bytes = spec.hidden_size * spec.dtype_bytes
        self.hdr_bytes = header_bytes(header_words)
        self.size = self.hdr_bytes + rows * spec.hidden_size * spec.dtype_bytes
        self.staging: dict[int, list[torch.Tensor]] = {}  # [peer][slot], from its first message
        self.links: dict[int, object] = {}
        self.completers: dict[int, Completer] = {}
        self.bell = EventDoorbell()
        self.seq = [0] * len(peers)
        selves: set[int] = set()
        if link_of is None:
            link_of, selves = _world_links(peers)
        self.link_of = link_of
        self.loops = {dst: loopback(tag) for dst in selves}  # lanes to ourselves

    def _open(self, dst: int) -> None:
        self.links[dst] = self.link_of(self.peers[dst])
        self.staging[dst] = [_staging(self.config, self.size) for _ in range(self.num_slots)]
        self.completers[dst] = Completer(self.bell, self.config.device)

    def write(self, dst: int, words: list[int], payload: torch.Tensor) -> None:
        t0 = time.perf_counter()
        seq = self.seq[dst] + 1
        if dst in self.loops:
            self.loops[dst].put(seq, words, payload)
            self.seq[dst] = seq
            self.stats.num_sends += 1
            self.stats.blocked_s += time.perf_counter() - t0
            return
        if dst not in self.completers:
            self._open(dst)
        slot, c = seq % self.num_slots, self.completers[dst]
        c.check()
        if c.done < seq - self.num_slots:  # the slot's previous isend is still in flight
            self.stats.num_backpressure += 1
            wait_for(lambda: True if c.done >= seq - self.num_slots or c.error else None, self.bell, self.policy)
            c.check()
            self.stats.backpressure_s += time.perf_counter() - t0
        elif c.done < seq - 1:
            self.stats.num_overlapped += 1
        buf, n = self.staging[dst][slot], payload.shape[0]
        header = torch.tensor([seq, *words], dtype=torch.int64, device=buf.device)
        buf[:8 * (1 + len(words))].view(torch.int64).copy_(header)
        end = self.hdr_bytes + n * self.row_bytes
        if n:
            buf[self.hdr_bytes:end].view(self.dtype).view(n, self.hidden).copy_(payload)
        c.post(self.links[dst].isend(buf[:end], self.tag + slot))
        self.seq[dst] = seq
        self.stats.num_sends += 1
        self.stats.blocked_s += time.perf_counter() - t0

    def goodbye(self, dst: int, timeout_s: float = 30.0) -> None:
        """Close the lane to ``dst``: fill its ``num_slots`` pre-posted receives with a closing header
        (seq < 0), so no thread there is left waiting on a receive that never comes; wait until
        every isend completed, then stop its thread. A lane written again later starts at seq 1."""
        c = self.completers.pop(dst, None)
        if c is not None:
            link = self.links.pop(dst)
            for k in range(1, self.num_slots + 1):
                seq = self.seq[dst] + k
                # NOTE: a buffer of its own: the staging slot may still be in flight.
                bye = torch.full((self.hdr_bytes // 8,), -seq, dtype=torch.int64, device=self.staging[dst][0].device)
                c.post(link.isend(bye, self.tag + seq % self.num_slots))
            total = self.seq[dst] + self.num_slots
            wait_for(lambda: True if c.done >= total or c.error else None, self.bell, self.policy, timeout_s)
            c.close()
            del self.staging[dst]
        self.seq[dst] = 0

    def close(self, timeout_s: float = 30.0) -> None:
        for dst in list(self.completers):
            self.goodbye(dst, timeout_s)


class LaneReceiver:
    """Pre-posted receives for several lanes (one peer each), ``num_slots`` per lane, posted once the
    lane is opened and its link has formed. ``lazy``: lanes open on ``open`` (a peer that may not
    exist yet), else all at once."""

    def __init__(self, config, peers: list[int], tag: int, header_words: int, rows: int, bell: Doorbell,
                 link_of: Callable[[int], object] | None = None, lazy: bool = False):
        spec = config.spec
        self.config, self.peers, self.tag, self.num_slots = config, peers, tag, spec.num_slots
        self.hidden, self.dtype, self.header_words = spec.hidden_size, getattr(torch, spec.dtype), header_words
        self.row_bytes = spec.hidden_size * spec.dtype_bytes
        self.hdr_bytes = header_bytes(header_words)
        self.size = self.hdr_bytes + rows * spec.hidden_size * spec.dtype_bytes
        self.bell = bell
        self.bufs: dict[int, list[torch.Tensor]] = {}  # [lane][slot]
        self.links: dict[int, object] = {}
        self.completers: dict[int, Completer] = {}
        self.posted: set[int] = set()  # lanes whose first receives are posted (their link formed)
        self.consumed = [0] * len(peers)
        self.closed = [False] * len(peers)
        selves: set[int] = set()
        if link_of is None:
            link_of, selves = _world_links(peers)
        self.link_of = link_of
        self.loops = {lane: loopback(tag) for lane in selves}  # lanes from ourselves
        for loop in self.loops.values():
            loop.bell = bell
        if not lazy:
            for lane in range(len(peers)):
                if lane not in self.loops:
                    self.open(lane)

    def open(self, lane: int) -> None:
        """Post the lane's receives once its link has formed (at once for a world rank)."""
        if lane in self.completers or lane in self.loops:
            return
        self.bufs[lane] = [_staging(self.config, self.size) for _ in range(self.num_slots)]
        self.completers[lane] = Completer(self.bell, self.config.device)
        self.links[lane] = link = self.link_of(self.peers[lane])
        link.when_ready(lambda: self._post_all(lane))

    def _post_all(self, lane: int) -> None:
        for seq in range(1, self.num_slots + 1):
            self._post(lane, seq % self.num_slots)  # in seq order: the completer waits in order
        self.posted.add(lane)
        self.bell.ring()

    def _post(self, lane: int, slot: int) -> None:
        self.completers[lane].post(self.links[lane].irecv(self.bufs[lane][slot], self.tag + slot))

    def ready(self, lane: int) -> bool:
        if lane in self.loops:
            return bool(self.loops[lane].queue)
        c = self.completers.get(lane)
        if c is None:
            return False
        c.check()
        if c.done <= self.consumed[lane] or self.closed[lane]:
            return False
        seq = self.consumed[lane] + 1
        if int(self.bufs[lane][seq % self.num_slots][:8].view(torch.int64)[0]) < 0:
            self.closed[lane] = True  # its sender said goodbye: nothing more will come
            return False
        return True

    def take(self, lane: int, out: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Copy the lane's next message out: (header words, payload view of ``out`` [n, H]); re-post."""
        seq = self.consumed[lane] + 1
        if lane in self.loops:
            self.consumed[lane] = seq
            return self.loops[lane].take(seq, out)
        slot = seq % self.num_slots
        buf = self.bufs[lane][slot]
        got_seq, *words = buf[:8 * (1 + self.header_words)].view(torch.int64).tolist()
        if got_seq == -seq:
            raise ProtocolError(f"lane {lane} (rank {self.peers[lane]}) was closed by its sender")
        if got_seq != seq:
            raise ProtocolError(f"lane {lane} (rank {self.peers[lane]}) slot {slot}: seq {got_seq}, expected {seq}")
        n = words[2]
        dst = out[:n]  # [n, H]
        if n:
            end = self.hdr_bytes + n * self.row_bytes
            dst.copy_(buf[self.hdr_bytes:end].view(self.dtype).view(n, self.hidden))
        self.consumed[lane] = seq
        self._post(lane, slot)  # receives message seq + num_slots
        return words, dst

    def drop(self, lane: int) -> None:
        """Forget the lane: its sender left (its goodbye, or its death, ends the posted receives'
        thread). Opened again, it starts at seq 1."""
        c = self.completers.pop(lane, None)
        if c is not None:
            self.links.pop(lane)
            self.bufs.pop(lane)
            self.posted.discard(lane)
            c.close(0.0)  # not joined: its posted receives end with the sender's goodbye, or its death
        self.consumed[lane], self.closed[lane] = 0, False

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for every sender's goodbye (see LaneSender.goodbye), then stop the threads. Close the
        senders of this process first: peers wait for their goodbyes as we wait for theirs. A lane
        whose link never formed has nothing posted and nothing to wait for."""
        bell = EventDoorbell()
        for lane, c in list(self.completers.items()):
            if lane not in self.posted:
                c.close(0.0)
                continue
            seen = self.consumed[lane]
            c.bell = bell
            wait_for(lambda: True if c.done >= seen + self.num_slots or c.error else None, bell,
                     POLICIES["block"], timeout_s)
            c.close()
