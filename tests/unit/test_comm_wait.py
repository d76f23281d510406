"""The wait policy's phases and the doorbells it blocks on."""
from __future__ import annotations

import mmap
import threading
import time

from moeflow.comm import POLICIES, WaitPolicy
from moeflow.comm.doorbell import Doorbell, EventDoorbell, FutexDoorbell, NapDoorbell
from moeflow.comm.wait import wait_for


def _bell():
    return FutexDoorbell(mmap.mmap(-1, 4096), 64)  # any shared mapping; a mailbox uses its own


def test_returns_at_once_when_ready_and_none_at_timeout():
    assert wait_for(lambda: 42, NapDoorbell(1e-3), WaitPolicy()) == 42
    t0 = time.perf_counter()
    assert wait_for(lambda: None, NapDoorbell(1e-3), WaitPolicy(), timeout_s=0.05) is None
    assert 0.05 <= time.perf_counter() - t0 < 0.5


def test_a_ring_wakes_a_blocked_waiter_long_before_its_timeout():
    bell, box = _bell(), []
    policy = WaitPolicy(spin_s=0, yield_s=0, block_timeout_s=5.0)  # would sleep 5 s unrung

    def later():
        time.sleep(0.05)
        box.append(1)
        bell.ring()

    threading.Thread(target=later).start()
    t0 = time.perf_counter()
    assert wait_for(lambda: box[0] if box else None, bell, policy, timeout_s=10) == 1
    assert time.perf_counter() - t0 < 1.0
    bell.close()


def test_a_ring_between_drain_and_wait_is_not_lost():
    bell = _bell()
    bell.drain()
    t0 = time.perf_counter()
    assert bell.wait(0.1) is False and time.perf_counter() - t0 >= 0.09  # nothing rang: full timeout
    bell.drain()
    bell.ring()  # after the drain, before the wait
    t0 = time.perf_counter()
    assert bell.wait(5.0) is True and time.perf_counter() - t0 < 0.5
    for _ in range(10_000):  # ringing never blocks, waiter or not
        bell.ring()
    bell.close()


def test_yield_phase_hands_over_and_event_doorbell_wakes():
    bell, box = EventDoorbell(), []
    t = threading.Timer(0.05, lambda: (box.append(7), bell.ring()))
    t.start()
    assert wait_for(lambda: box[0] if box else None, bell, POLICIES["block"], timeout_s=5) == 7
    calls = [0]

    def poll():
        calls[0] += 1
        return True if calls[0] > 50 else None

    assert wait_for(poll, NapDoorbell(1e-3), POLICIES["yield"], timeout_s=5) is True


def test_a_ring_from_another_process_wakes_the_waiter(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bell"  # any shared file mapping works like a /dev/shm segment
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 4096)
    bell = FutexDoorbell(buf, 64)
    ringer = ("import mmap, time, sys; from moeflow.comm.doorbell import FutexDoorbell; "
              "f = open(sys.argv[1], 'r+b'); b = FutexDoorbell(mmap.mmap(f.fileno(), 4096), 64); "
              "time.sleep(0.3); b.ring()")
    bell.drain()
    p = subprocess.Popen([sys.executable, "-c", ringer, str(path)])
    try:
        t0 = time.perf_counter()
        woke = bell.wait(20.0)  # the block timeout: a lost ring would sleep this long
        assert woke and time.perf_counter() - t0 < 10.0
    finally:
        p.wait(30)
        bell.close()
        buf.close()


# Two ringer processes share one futex doorbell with a waiter (this process). Shared int64 words:
# 0 go, 1 + k ringer k ready, 8 the doorbell (its low half), 16 + 8k ringer k's flag, 32 + 8k its ack.
_RINGER = """
import mmap, os, sys
from moeflow.comm.doorbell import FutexDoorbell
path, k, mode, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with open(path, "r+b") as f:
    buf = mmap.mmap(f.fileno(), 4096)
bell, words = FutexDoorbell(buf, 64), memoryview(buf).cast("q")
words[1 + k] = 1
while words[0] == 0:
    os.sched_yield()
for i in range(1, n + 1):
    if mode == "messages":  # publish message i, ring, wait until the waiter has taken it
        words[16 + 8 * k] = i
        bell.ring()
        while words[32 + 8 * k] != i:
            os.sched_yield()
    else:
        bell.ring()
"""


def _with_two_ringers(tmp_path, mode: str, n: int, waiter) -> int:
    """Run ``waiter(bell, words)`` while two ringer processes ring; returns the doorbell word after."""
    import subprocess
    import sys

    path = tmp_path / "bell"
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 4096)
    bell, words = FutexDoorbell(buf, 64), memoryview(buf).cast("q")
    procs = [subprocess.Popen([sys.executable, "-c", _RINGER, str(path), str(k), mode, str(n)]) for k in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not (words[1] and words[2]):  # both started: ring together
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a ringer did not start"
            time.sleep(0.01)
        words[0] = 1
        waiter(bell, words)
        assert [p.wait(120) for p in procs] == [0, 0]
        return bell._cell.value
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        words.release()
        bell.close()
        buf.close()


def test_concurrent_rings_are_all_counted(tmp_path):
    # The ring's add is atomic: a read-modify-write from Python loses some of 2 x 20000 (about 900 here).
    assert _with_two_ringers(tmp_path, "count", 20_000, lambda bell, words: None) == 40_000


def test_two_ringers_never_leave_the_waiter_asleep_past_a_ready_message(tmp_path):
    n = 500

    class Watched(Doorbell):
        def __init__(self, bell):
            self.bell, self.num_timeouts = bell, 0

        def drain(self):
            self.bell.drain()

        def wait(self, timeout_s):
            woke = self.bell.wait(timeout_s)
            self.num_timeouts += not woke
            return woke

    def waiter(bell, words):
        watched = Watched(bell)
        policy = WaitPolicy(spin_s=0, yield_s=0, block_timeout_s=10.0, idle_block_s=10.0)  # always block
        for _ in range(2 * n):
            k = wait_for(lambda: next((k for k in (0, 1) if words[16 + 8 * k] != words[32 + 8 * k]), None),
                         watched, policy, timeout_s=60)
            assert k is not None
            words[32 + 8 * k] = words[16 + 8 * k]
        # Ringers never pause 10 s: a block that ran out its timeout slept through a ring.
        assert watched.num_timeouts == 0

    _with_two_ringers(tmp_path, "messages", n, waiter)
