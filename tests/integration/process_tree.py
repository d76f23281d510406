"""A command's process tree, read from /proc, for the tests that stop it with a signal."""
from __future__ import annotations

import os
import signal

from moeflow.bench.server_process import is_alive  # noqa: F401  (a zombie counts as exited)


def ppids() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(pid: int) -> set[int]:
    parents, found, frontier = ppids(), set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def default_signals() -> None:
    """In the child before exec: a test run in the background (signals ignored) must not pass that on."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
