"""The worker control loop every role runs: the engine's control messages over the worker's pipe.

Until ``Shutdown``: ``DumpSpans`` is answered with the tracer's spans, any other message (a
``RunWork``) goes to the role's handler. An expert-side worker has no work messages: between polls
of the pipe it runs ``turn`` (one look at its buffers); an attention-side worker blocks on the pipe.
Every few seconds, between messages, the freed heap goes back to the OS (``heap.py``).
"""
from __future__ import annotations

import threading
from typing import Callable

from moeflow.messages import DumpSpans, Shutdown, Spans
from moeflow.workers.heap import HeapTrimmer
from moeflow.workers.tracer import Tracer


def serve_control(conn, role: str, index: int, tracer: Tracer, on_message: Callable[[object], None] | None = None,
                  turn: Callable[[], bool] | None = None) -> None:
    """``turn()`` returns False to stop (its loop failed); without ``turn`` the loop blocks on ``conn``."""
    heap = HeapTrimmer()
    while True:
        heap.maybe()
        if turn is None or conn.poll():
            msg = conn.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, DumpSpans):
                conn.send(Spans(role, index, tracer.drain()))
            elif on_message is not None:
                on_message(msg)
        if turn is not None and not turn():
            return


class LockedConn:
    """A control pipe whose sends may come from two threads (an expert mover's report, the loop's
    answers): one at a time. Reads stay the loop's."""

    def __init__(self, conn):
        self.conn, self._lock = conn, threading.Lock()

    def send(self, obj) -> None:
        with self._lock:
            self.conn.send(obj)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def recv(self):
        return self.conn.recv()
