"""Completer: the thread that waits on one peer's torch.distributed works, in posting order.

gloo marks a work completed only for a thread that waits on it (``get_future`` is not implemented),
so each peer's lane has one such thread, the GIL released while it waits (``lanes.py``).
"""
from __future__ import annotations

import queue
import threading

import torch

from moeflow.comm.doorbell import Doorbell


class Completer:
    """Waits on one peer's works, in posting order, in a daemon thread; ``done`` counts them."""

    def __init__(self, bell: Doorbell | None, device: str = "cpu"):
        self.bell, self.done, self.error, self.is_cuda = bell, 0, None, device.startswith("cuda")
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def post(self, work) -> None:
        self._q.put(work)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"torch.distributed transfer failed: {self.error}") from self.error

    def _run(self) -> None:
        while (work := self._q.get()) is not None:
            try:
                work.wait()
                if self.is_cuda:
                    torch.cuda.current_stream().synchronize()
            except Exception as e:  # a peer died or the group was destroyed
                self.error = e
                return
            self.done += 1  # only this thread writes it; readers see whole ints under the GIL
            if self.bell is not None:
                self.bell.ring()

    def close(self, join_s: float = 5.0) -> None:
        # joined: a thread inside gloo at group destruction aborts the exit (a stuck receive stays: no cancel)
        self._q.put(None)
        self._thread.join(join_s)
