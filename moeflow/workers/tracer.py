"""Span recording for the deployment trace: every worker thread appends intervals on the shared
monotonic clock (CLOCK_MONOTONIC is one clock for all processes of a Linux host)."""
from __future__ import annotations

import threading

from moeflow.messages import Span

_MAX_SPANS = 500_000  # bounded: a long-running server must not grow without limit


class Tracer:
    def __init__(self, role: str, index: int, enabled: bool = True):
        self.prefix = f"{role}{index}"
        self.enabled = enabled
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.num_dropped = 0

    def add(self, name: str, start_s: float, end_s: float, thread: str = "main", **args) -> None:
        if not self.enabled:
            return
        with self._lock:
            if len(self._spans) >= _MAX_SPANS:
                self.num_dropped += 1
                return
            self._spans.append(Span(name, f"{self.prefix}/{thread}", start_s, end_s, args))

    def drain(self) -> list[Span]:
        with self._lock:
            spans, self._spans = self._spans, []
        return spans
