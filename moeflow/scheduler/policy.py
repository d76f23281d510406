"""Scheduling policies share one interface so engines and the simulator can swap them."""
from __future__ import annotations

import abc

from moeflow.core import Batch, Request


class SchedulingPolicy(abc.ABC):
    """schedule -> (execute elsewhere) -> update; pure Python, no clock of its own."""

    @abc.abstractmethod
    def add(self, request: Request) -> None: ...

    @abc.abstractmethod
    def schedule(self) -> Batch | None:
        """The next batch to run, or None when there is nothing to do."""

    @abc.abstractmethod
    def update(self, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        """Apply one finished batch (request id -> sampled token); returns requests now finished."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str) -> Request | None: ...

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...
