"""The decode side of a prefill/decode handoff, on the pool's ints: blocks pre-allocated for a
request whose prompt KV is still on its way (invisible to the schedulers until it has arrived),
then the request joins its group's running set with its prompt counted as computed.

SGLang's decode side keeps such requests in a pre-allocation queue; vLLM's scheduler parks them
until the connector reports the blocks loaded. Here they are a table of ids per group: the
schedulers iterate ``Group.requests`` only, so an arriving request cannot be stepped early.
"""
from __future__ import annotations

from moeflow.core import Request, RequestStatus
from moeflow.scheduler.pool import RequestPool


class Arrivals:
    """Per pool: the requests with blocks reserved for an incoming transfer, by group."""

    def __init__(self, pool: RequestPool):
        self.pool = pool
        self.reserved: dict[str, int] = {}  # request id -> group whose blocks wait for its KV

    def count(self, gid: int) -> int:
        return sum(1 for g in self.reserved.values() if g == gid)

    def best_group(self, r: Request) -> int | None:
        """The live group with the most free blocks that has room for ``r`` (its known tokens, or its
        whole life under ``reserve`` admission) and a sequence slot (None: no group has); never one
        that drains (it is leaving: ``scheduler/groups.drain``)."""
        pool, best = self.pool, None
        num_tokens = pool.admit_tokens(r)
        for gid, g in enumerate(pool.groups):
            a = g.allocator
            if g.dead or g.draining or len(g.requests) + self.count(gid) >= pool.max_num_seqs or a.blocks_for(num_tokens) > a.num_free:
                continue
            if best is None or a.num_free > pool.groups[best].allocator.num_free:
                best = gid
        return best

    def reserve(self, gid: int, r: Request) -> tuple[int, ...]:
        """``r``'s blocks in group ``gid`` (``best_group`` found the room)."""
        self.reserved[r.request_id] = gid
        return self.pool.groups[gid].allocator.allocate(r.request_id, self.pool.admit_tokens(r))

    def cancel(self, request_id: str) -> None:
        """The transfer failed or the request ended before its KV arrived: its blocks are freed."""
        gid = self.reserved.pop(request_id, None)
        if gid is not None:
            self.pool.groups[gid].allocator.free(request_id)

    def arrive(self, r: Request) -> int:
        """``r``'s prompt KV is in its reserved blocks: it runs in that group from its next step
        (the first token, sampled by the prefill side, is already in ``r.output_token_ids``)."""
        pool = self.pool
        gid = self.reserved.pop(r.request_id)
        r.num_computed_tokens = r.num_prompt_tokens
        r.status = RequestStatus.RUNNING
        pool.requests[r.request_id] = r
        pool.groups[gid].requests.append(r)
        pool.group_of[r.request_id] = gid
        return gid
