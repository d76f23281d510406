"""``KvPort``: all that a KV handoff's side may do to its engine. The pool operations are here, on
the engine's ``RequestPool``; what only the engine knows (how many processes hold a group's KV,
how to reach them, what else an arrived request needs) comes in as callables. The simulator's
systems get the same port on their pools, without the callables.
"""
from __future__ import annotations

from typing import Any, Callable

from moeflow.core import Request
from moeflow.scheduler.handoff.arrivals import Arrivals
from moeflow.scheduler.pool import RequestPool


class KvPort:
    def __init__(self, pool: RequestPool, members: Callable[[int], int] = lambda group: 1,
                 send: Callable[[int, Any], None] | None = None,
                 on_arrive: Callable[[Request], None] | None = None,
                 regions: Callable[[int], tuple | None] = lambda group: None):
        """``members(group)``: processes holding a share of that group's KV; ``send(group, message)``:
        a copy message to each of them; ``on_arrive(request)``: the engine's own bookkeeping for a
        request that starts decoding from handed-over KV (after the pool took it); ``regions(group)``:
        where others may read that group's caches in place, one per member (None: they may not)."""
        self.arrivals = Arrivals(pool)
        self.members, self._send, self._on_arrive, self.regions = members, send, on_arrive, regions

    @property
    def pool(self) -> RequestPool:
        return self.arrivals.pool

    def send(self, group: int, message) -> None:
        if self._send is None:
            raise RuntimeError("this engine hands no KV blocks over")
        self._send(group, message)

    # -- the prefill side: finished requests' leased blocks --------------------------------------

    def leased(self, request_id: str) -> tuple[int, tuple[int, ...]] | None:
        """(group, blocks) a finished request still holds (None: no lease)."""
        gid = self.pool.leases.get(request_id)
        return None if gid is None else (gid, self.pool.groups[gid].allocator.table(request_id))

    def end_lease(self, request_id: str) -> None:
        self.pool.end_lease(request_id)

    # -- the decode side: blocks reserved for KV on its way ----------------------------------------

    def check(self, request: Request) -> None:
        """Raise ``RequestError`` if the pool could never hold ``request`` (before its KV is fetched)."""
        self.pool.check(request, None)

    def room(self, request: Request) -> int | None:
        return self.arrivals.best_group(request)

    def free_blocks(self, group: int | None = None) -> int:
        """Free KV blocks of ``group`` (None: of every live group)."""
        groups = self.pool.groups if group is None else [self.pool.groups[group]]
        return sum(g.allocator.num_free for g in groups if not g.dead)

    def reserve(self, group: int, request: Request) -> tuple[int, ...]:
        return self.arrivals.reserve(group, request)

    def cancel(self, request_id: str) -> None:
        self.arrivals.cancel(request_id)

    def arrive(self, request: Request) -> int:
        gid = self.arrivals.arrive(request)
        if self._on_arrive is not None:
            self._on_arrive(request)
        return gid
