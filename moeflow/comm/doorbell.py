"""Doorbells: how a waiter that gave up polling is woken. Ringing never waits.

A receiver spins, then yields, then blocks on its doorbell (see ``wait.py``); every sender rings
after it sets a ready flag. Three kinds:

- ``FutexDoorbell``: a word in the shared buffer, for waiters in another process.
- ``EventDoorbell``: a ``threading.Event``, for a waiter woken by threads of its own process
  (the torch.distributed transport's completion threads).
- ``NapDoorbell``: nobody rings; waiting is a short sleep (a sender under backpressure).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
import time


class Doorbell:
    def ring(self) -> None:
        """Wake the waiter, if any. Never blocks."""

    def drain(self) -> None:
        """Forget earlier rings. A waiter drains, re-checks its condition, then waits, so a ring
        that lands after the drain is never lost."""

    def wait(self, timeout_s: float) -> bool:
        """Block until rung or ``timeout_s`` passed (whichever first); True if rung."""
        time.sleep(timeout_s)
        return False

    def close(self) -> None:
        pass


class FutexDoorbell(Doorbell):
    """A 32-bit word in a shared mapping, rung with FUTEX_WAKE_OP, waited on with FUTEX_WAIT.

    Ringing adds 1 to the word and wakes every waiter, both done by the kernel under the futex's
    bucket lock (FUTEX_WAKE_OP with FUTEX_OP_ADD: a locked add, a full barrier). A waiter remembers
    the word when it drains, re-checks its condition, then waits only while the word is unchanged
    (the kernel compares it under the same lock). So a ring after the drain is never lost: the
    ringer's flag store is visible before its add, a waiter that re-checked without seeing the
    flag drained before the add, and the word, which only grows, no longer holds what it drained.
    verify/protocol.pml checks this exhaustively (docs/protocol_model.md).

    NOTE: the add must be atomic, and Python has no atomic read-modify-write on shared memory.
    The first version stored ``word + 1`` from Python: two ringers could read the same value, and
    one preempted between its load and its store could move the word back to a value a waiter had
    drained, which then slept through a ready message until its timeout (the model's counterexample
    "old-ring"). FUTEX_WAKE_OP makes the add atomic with no C helper, and a ring stays one syscall.

    Chosen over a FIFO in /dev/shm (the first version): it needs no file of its own, and a futex
    wake is not a "sync" wakeup, as a pipe write is, which tells the scheduler that the waker is
    about to sleep, so it may run the woken receiver on the still-busy sender's core. On the
    2-core VM the two measured alike within its noise (both show an occasional ~100 us ring).
    """

    def __init__(self, buf, offset: int):
        self._cell = ctypes.c_int32.from_buffer(buf, offset)  # NOTE: holds an export of ``buf``
        self._addr = ctypes.addressof(self._cell)
        self._seen = 0

    def ring(self) -> None:
        if _SYS_FUTEX is None:  # pragma: no cover - another architecture: waiters nap instead
            return
        if _futex(self._addr, _FUTEX_WAKE_OP, _WAKE_ALL, None, self._addr, _ADD_ONE) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"FUTEX_WAKE_OP: {os.strerror(err)}")

    def drain(self) -> None:
        self._seen = self._cell.value

    def wait(self, timeout_s: float) -> bool:
        t = max(0.0, timeout_s)
        ts = _Timespec(int(t), int((t - int(t)) * 1e9))
        if _futex(self._addr, _FUTEX_WAIT, self._seen, ctypes.byref(ts)) == 0:
            return True
        return ctypes.get_errno() == errno.EAGAIN  # rung between drain and wait

    def close(self) -> None:
        self._cell = None  # releases the export, so the mapping can close


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC = ctypes.CDLL(None, use_errno=True)  # NOTE: CDLL calls release the GIL while blocked
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5  # not FUTEX_PRIVATE: the word is shared between processes
_WAKE_ALL = 0x7FFFFFFF
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): add 1 to the second word. The compare decides
# only whether to wake waiters of the second word too; it is the same word, already woken.
_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0


def _futex(addr: int, op: int, val: int, timeout, addr2: int | None = None, val3: int = 0) -> int:
    if _SYS_FUTEX is None:  # pragma: no cover - another architecture: degrade to naps
        time.sleep(1e-4)
        return -1
    return _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), op, val, timeout, ctypes.c_void_p(addr2), val3)


class EventDoorbell(Doorbell):
    def __init__(self):
        self._event = threading.Event()

    def ring(self) -> None:
        self._event.set()

    def drain(self) -> None:
        self._event.clear()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(max(0.0, timeout_s))


class NapDoorbell(Doorbell):
    """No ringer: the waiter naps ``nap_s`` at most, then looks again."""

    def __init__(self, nap_s: float):
        self.nap_s = nap_s

    def wait(self, timeout_s: float) -> bool:
        time.sleep(max(0.0, min(timeout_s, self.nap_s)))
        return False
