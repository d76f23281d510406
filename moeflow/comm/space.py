"""The room left in /dev/shm, and a clear refusal when a deployment's segments would not fit.

tmpfs hands out pages as they are touched: a file sized with ``ftruncate`` reserves nothing, and a
mapping whose page cannot be backed kills the process that touches it with SIGBUS, naming nothing.
So segments reserve their bytes with ``posix_fallocate`` when created (``segment.py``), and an
engine checks the sum of its segments against the free space before it starts any worker.
"""
from __future__ import annotations

import os

from moeflow.config import ConfigError

MIB = 1 << 20


class ShmSpaceError(ConfigError):
    """/dev/shm cannot hold what a deployment (or one of its segments) needs."""


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def mount_of(directory: str) -> str:
    """'<fstype> mounted on <point>, size N MiB' for the mount holding ``directory``."""
    best = ("?", "/")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and _under(directory, parts[1]) and len(parts[1]) >= len(best[1]):
                    best = (parts[2], parts[1])
    except OSError:
        pass
    st = os.statvfs(directory)
    return f"{best[0]} mounted on {best[1]}, size {st.f_blocks * st.f_frsize / MIB:.0f} MiB"


def _under(path: str, mount_point: str) -> bool:
    path, mount_point = os.path.realpath(path), mount_point.rstrip("/") or "/"
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def refusal(directory: str, needed: int, what: str) -> ShmSpaceError:
    free = free_bytes(directory)
    return ShmSpaceError(
        f"{directory} has {free} bytes ({free / MIB:.1f} MiB) free, {what} needs {needed} bytes ({needed / MIB:.1f} "
        f"MiB) ({mount_of(directory)}): free space there or enlarge it (e.g. mount -o remount,size=... "
        f"{directory}; docker run --shm-size=...)")


def check_room(directory: str, needed: int, what: str) -> None:
    """Raise ShmSpaceError, naming the bytes needed, the bytes free and the mount, unless ``needed`` fit."""
    if needed > free_bytes(directory):
        raise refusal(directory, needed, what)
