"""Segment: one POSIX shared-memory file in /dev/shm, mapped into this process.

Names are ``moeflow-<deployment>.<what>``; ``cleanup(deployment)`` removes everything of one
deployment, so the process that launched it can clean up after workers that were SIGKILLed. A
deployment id that starts with ``<pid>-`` (an engine's, ``<pid>-<hex>``) names the process that
owns it: that process's reaper (``reaper.py``) unlinks what it left behind once it dies, SIGKILL
included, and ``reclaim_stale`` does at the next start what a reaper could not (a killed reaper).
Every segment reserves its bytes when created (``posix_fallocate``): on a full tmpfs that fails at
once with the numbers (``space.py``) instead of a SIGBUS at the first page nobody can back.
Files are created mode 0600 (owner only) under a temporary name, initialized, then renamed into
place: an attacher never sees a half-initialized segment, and a restart with the same deployment
id atomically replaces stale ones. Linux only (/dev/shm is where shm_open puts them).

We use raw files rather than ``multiprocessing.shared_memory``: before Python 3.13 every
attaching process registers the segment with its resource tracker, which unlinks it when that
process exits, taking the buffer away from its owner.
"""
from __future__ import annotations

import glob
import mmap
import os
import re
import errno
import time
from typing import Callable

from moeflow.comm import reaper
from moeflow.comm.space import refusal

SHM_DIR = "/dev/shm"
PREFIX = "moeflow-"
_DEPLOYMENT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OWNED_RE = re.compile(r"^(?P<pid>[0-9]+)-[A-Za-z0-9_-]*$")  # a deployment id that names its owner


def check_deployment_id(deployment_id: str) -> str:
    # NOTE: '.' separates the deployment from the rest of the name; allowing it would let
    # cleanup("a") match deployment "a.b".
    if not isinstance(deployment_id, str) or not _DEPLOYMENT_RE.match(deployment_id):
        raise ValueError(f"deployment id must match {_DEPLOYMENT_RE.pattern}, got {deployment_id!r}")
    return deployment_id


def segment_path(deployment_id: str, what: str) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{check_deployment_id(deployment_id)}.{what}")


def list_segments(deployment_id: str) -> list[str]:
    """Every /dev/shm entry of this deployment (its segments, and leftovers of a crash)."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{check_deployment_id(deployment_id)}.*")))


def cleanup(deployment_id: str) -> list[str]:
    """Unlink everything of ``deployment_id``; returns what was removed. Safe to call twice."""
    removed = []
    for path in list_segments(deployment_id):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def owner_pid(deployment_id: str) -> int | None:
    """The pid of the process that owns ``deployment_id`` (ids ``<pid>-...``), else None."""
    m = _OWNED_RE.match(deployment_id)
    return int(m["pid"]) if m else None


def reclaim_stale() -> dict[str, int]:
    """Unlink every segment whose owner process is gone (a run that was SIGKILLed, or killed before
    it could clean up); returns the bytes freed per deployment id. Only ``moeflow-<pid>-...`` names:
    others have no owner to check and are left alone, as is everything of a live pid (even a pid
    since reused by another program: kept until that one exits too)."""
    freed: dict[str, int] = {}
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*.*")):
        deployment_id = _deployment_of(path)
        pid = owner_pid(deployment_id)
        if pid is None or pid_alive(pid):
            continue
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:  # gone already (another starting process was first), or another user's
            continue
        freed[deployment_id] = freed.get(deployment_id, 0) + size
    return freed


def _deployment_of(path: str) -> str:
    return os.path.basename(path)[len(PREFIX):].split(".", 1)[0]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """A mapped shared-memory file. ``buf`` is the mmap (a writable buffer for torch/memoryview)."""

    def __init__(self, path: str, buf: mmap.mmap, is_owner: bool):
        self.path, self.buf, self.is_owner = path, buf, is_owner
        self.size_bytes = len(buf)

    @classmethod
    def create(cls, path: str, size_bytes: int, init: Callable[[mmap.mmap], None]) -> "Segment":
        """Create ``path`` (replacing any stale file), run ``init`` on the zeroed mapping, publish."""
        if owner_pid(_deployment_of(path)) == os.getpid():
            reaper.watch()  # before the file exists: it is never left behind, however we die
        tmp = f"{path}.tmp{os.getpid()}"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the open mode is masked by umask; be exact
            os.ftruncate(fd, size_bytes)
            room = _reserve(fd, size_bytes)
            buf = _map(fd, size_bytes) if room else None
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)  # the mapping keeps the file alive
        if buf is None:
            os.unlink(tmp)  # first, so the free space reported is what there really is
            raise refusal(os.path.dirname(path), size_bytes, f"segment {os.path.basename(path)}")
        init(buf)
        os.rename(tmp, path)
        return cls(path, buf, is_owner=True)

    @classmethod
    def attach(cls, path: str, accept: Callable[[mmap.mmap], bool], timeout_s: float,
               writable: bool = True) -> "Segment":
        """Map an existing segment once ``accept`` says it is the live one (a stale file of a
        crashed run is refused until its owner's successor replaces it); read-only unless ``writable``."""
        deadline = time.monotonic() + timeout_s
        nap = 1e-3
        while True:
            try:
                fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                try:
                    size = os.fstat(fd).st_size
                    buf = _map(fd, size, writable) if size > 0 else None
                finally:
                    os.close(fd)
                if buf is not None and accept(buf):
                    return cls(path, buf, is_owner=False)
                if buf is not None:
                    buf.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no live shared buffer at {path} after {timeout_s:.1f} s")
            time.sleep(nap)
            nap = min(nap * 2, 50e-3)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views still held elsewhere keep the mapping (not the name)."""
        if self.is_owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            self.buf.close()
        except BufferError:
            pass  # a tensor or memoryview still views it; the mapping goes when they do


def _reserve(fd: int, size_bytes: int) -> bool:
    """Back every byte now; False: the file system has no room for them."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            return False
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: as before
            raise
    return True


def _map(fd: int, size: int, writable: bool = True) -> mmap.mmap:
    # MAP_POPULATE maps every page now, once: a message never pays page faults (static allocation).
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
