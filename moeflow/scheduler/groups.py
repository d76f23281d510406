"""Attention groups that join and leave a serving deployment, on the scheduler's side (pure Python, so
the simulator can run the same bookkeeping).

A group joins at the end of ``pool.groups`` with a fresh KV allocator and is scheduled from the next
turn (a scheduler that places requests by rank, dep's and afd's, is told: ``Placement.include``). A group that leaves is first *draining*: it admits nothing new (``RequestPool.room_for``), and its
resident requests either run to their end there (a request preempted there comes back to it: its
worker keeps the request's sampler state) or are handed to a group that stays (``hand_over``: the
caller copies the KV positions it computed from the old blocks to the new). Once it holds nothing (``settled``) it is removed; only the last groups
leave, so every other group keeps its index.
"""
from __future__ import annotations

from moeflow.scheduler.block_allocator import BlockAllocator
from moeflow.scheduler.pool import Group, RequestPool, Scheduler


def add_group(sched: Scheduler, num_blocks: int, block_size: int) -> int:
    """A new group at the end, with an empty cache of ``num_blocks``; its index."""
    sched.pool.groups.append(Group(BlockAllocator(num_blocks, block_size)))
    gid = len(sched.pool.groups) - 1
    if (placement := getattr(sched, "placement", None)) is not None:
        placement.include(gid)
    return gid


def drain(sched: Scheduler, gid: int) -> None:
    """Group ``gid`` admits nothing new from now on (a request placed there at arrival moves on)."""
    sched.pool.groups[gid].draining = True
    if (placement := getattr(sched, "placement", None)) is not None:
        placement.exclude(gid)


def hand_over(sched: Scheduler, r, dst: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """Move resident ``r`` (not on the workers) to group ``dst``, with blocks there for the positions
    it computed: (its old blocks, its new ones, those positions), the old ones freed once the caller
    has copied them; None when ``dst`` has no room for it."""
    pool, rid = sched.pool, r.request_id
    src = pool.group_of[rid]
    if rid in pool.in_flight or src == dst:
        raise ValueError(f"request {rid} cannot move from group {src} to {dst}: "
                         f"{'it is on the workers' if rid in pool.in_flight else 'the same group'}")
    g, h = pool.groups[src], pool.groups[dst]
    n = r.num_computed_tokens
    if h.allocator.blocks_for(max(n, 1)) > h.allocator.num_free or len(h.requests) >= pool.max_num_seqs:
        return None
    old = g.allocator.table(rid)
    new = tuple(h.allocator.grow(rid, n))
    g.requests.remove(r)
    h.requests.append(r)
    pool.group_of[rid] = dst
    return old, new, n


def release_blocks(sched: Scheduler, src: int, rid: str) -> None:
    """The old blocks of a request ``hand_over`` moved from group ``src``, once copied."""
    sched.pool.groups[src].allocator.free(rid)


def settled(pool: RequestPool, gid: int) -> bool:
    """Whether draining group ``gid`` holds nothing: no resident, preempted, leased or running request."""
    g = pool.groups[gid]
    return (not g.requests and not g.busy and not pool.pinned_to(gid) and gid not in pool.leases.values()
            and not any(pool.pinned.get(r.request_id) == gid for rs in pool.held.values() for r in rs))


def remove_last(pool: RequestPool, count: int) -> None:
    """Drop the last ``count`` groups, which must be settled."""
    n = len(pool.groups)
    if count >= n:
        raise ValueError(f"{count} of {n} groups cannot leave: none would be left")
    unsettled = [g for g in range(n - count, n) if not settled(pool, g)]
    if unsettled:
        raise ValueError(f"groups {unsettled} cannot leave: they still hold requests")
    del pool.groups[n - count:]
