"""The reaper: a small process that outlives its owner and unlinks the owner's shared memory.

A process that creates segments named for itself (``moeflow-<pid>-...``, ``segment.py``) starts one
reaper, once: a separate Python run of this file, with no moeflow or torch import, in its own
session (a Ctrl-C or hang-up of the owner's terminal does not reach it), reading a pipe whose only
writer is the owner. The pipe ends when the owner ends, however it ends (SIGKILL included); the
reaper then unlinks every ``moeflow-<owner pid>-*`` name still in /dev/shm and exits. An owner that
shut down cleanly has unlinked its segments already, and the reaper finds nothing. So a killed
server's KV arena and mailboxes are gone within a moment of its death, not at the next start.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

SHM_PATTERN = "/dev/shm/moeflow-{pid}-*"
_started_for: int | None = None  # the pid this process started its reaper as (a fork is another owner)
_keep: list[int] = []  # the pipe's write end: never closed, it closes when this process ends


def watch() -> None:
    """Start this process's reaper, once."""
    global _started_for
    if _started_for == os.getpid():
        return
    r, w = os.pipe()
    try:
        # -I -S: no site, no script directory on the path (moeflow/comm's modules shadow no stdlib one then)
        subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())], stdin=r,
                         stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    finally:
        os.close(r)
    os.set_inheritable(w, False)  # our children must not keep the pipe open after we die
    _started_for = os.getpid()
    _keep.append(w)


def reap(pid: int) -> list[str]:
    """Unlink what ``pid`` left in /dev/shm; returns what was removed."""
    removed = []
    for path in glob.glob(SHM_PATTERN.format(pid=pid)):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone already
            pass
    return removed


def main(pid: int) -> None:
    while os.read(0, 1):  # blocks until the owner is gone (EOF)
        pass
    reap(pid)


if __name__ == "__main__":
    main(int(sys.argv[1]))
