"""What the elastic systems of global steps (``elastic_afd.py``, ``elastic_dep.py``) share: the queue as
their controller sees it, and a membership change carried out as the engine does, between steps once it
is ready."""
from __future__ import annotations

from moeflow.scheduler.load_window import oldest_unanswered


class ElasticSteps:
    """``_change``: the change under way, (side, target, ready at; None: once the leavers are drained)."""

    _change: tuple | None = None

    def sampled(self, batch, finished, now) -> None:
        """The controller's window sees each request's tokens and its end, as the engine's does."""
        for s in batch.seqs:
            if s.is_last_chunk:
                self.window.token(s.request_id, now)
        for r in finished:
            self.window.finished(r.request_id, r.arrival_s)
        super().sampled(batch, finished, now)

    def _queue(self) -> tuple[int, float | None]:
        """The requests waiting, and the oldest unanswered one's arrival. A request that arrived with its KV
        (sim.decode_side) waits for room outside the pool: queued too, and its wait is one for a first
        token here."""
        pool = self.sched.pool
        queue = len(pool.waiting) + sum(map(len, pool.held.values())) + len(self.handed)
        oldest = min((t for t in (oldest_unanswered(pool), self.handed[0].arrival_s if self.handed else None)
                      if t is not None), default=None)
        return queue, oldest

    def _idle_boundary(self) -> None:
        """A change that became ready while no step runs takes effect now."""
        if not self.busy:
            self._boundary()
            self.poke()

    def _step(self) -> None:
        self._boundary()
        super()._step()

    def _due(self) -> tuple | None:
        """(side, target) of the change under way once its joiners are ready; None before, or without one."""
        if self._change is None:
            return None
        side, target, ready = self._change
        return None if ready is not None and self.loop.now < ready else (side, target)

    def _boundary(self) -> None:
        """Between steps: the change under way takes effect once it can."""
        raise NotImplementedError
