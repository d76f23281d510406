"""DWDP's scheduler: the dep ranks' batching, without the global step.

Every rank runs the whole model on its own requests, so a rank that finished its batch takes its
next one at once (its running requests' next step, then waiting requests placed as in dep:
least-loaded among the idle ranks, or fixed in turn at arrival); a busy rank is left alone and no
rank ever waits for another. The engine releases a rank when its work item is done.
"""
from __future__ import annotations

from moeflow.core import Work
from moeflow.scheduler.dep import PLACEMENTS, DepScheduler
from moeflow.scheduler.pool import RequestPool


class DwdpScheduler(DepScheduler):
    def schedule(self, now: float = 0.0) -> list[Work]:
        idle = {i for i, g in enumerate(self.pool.groups) if not g.busy and not g.dead}
        works = []
        for i, pieces in enumerate(self._plan(idle)):
            if pieces:
                self.pool.groups[i].busy = True
                works.append(Work(i, (self._batch(pieces),)))
        return works


def build(layout, pool: RequestPool, max_num_batched_tokens: int) -> DwdpScheduler:
    return DwdpScheduler(pool, PLACEMENTS[layout.placement](len(pool.groups)), layout.max_batch_tokens,
                         layout.chunked_prefill_size)
