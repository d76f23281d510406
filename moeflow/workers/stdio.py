"""The engine's stdout and stderr, handed to a worker at its start.

A forked worker's descriptors 1 and 2 are the fork server's, which are the engine's as they were
when the server started. The engine's may have moved since (a test runner captures each test's
output on descriptors 1 and 2 in turn), and a worker's output (its logging, a native crash's
faulthandler dump) belongs where the engine's goes now, as it did when every worker was spawned.
"""
from __future__ import annotations

import os
from multiprocessing import reduction


def _opened(dup) -> int:
    return dup.detach()


class _Fd:
    """A descriptor of the engine's, duplicated into the worker while the worker is being started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _opened, (reduction.DupFd(self.fd),)  # only while a process is being started


class Stdio:
    """The engine's descriptors 1 and 2 (pickled into a worker's start); ``adopt`` in the worker."""

    def __init__(self):
        self.out, self.err = _Fd(1), _Fd(2)

    def adopt(self) -> None:
        for fd, target in ((self.out, 1), (self.err, 2)):
            os.dup2(fd, target)
            os.close(fd)
