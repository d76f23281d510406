"""A process's reaper unlinks the shared memory it owned once it dies, SIGKILL included; a process
that ends cleanly has left nothing for it."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

SCRIPT = """
import os, sys, time
from moeflow.comm.kv_arena import KvArena, arena_path
a = KvArena.create(arena_path(f"{os.getpid()}-reaptest"), 1 << 16)
print(a.segment.path, flush=True)
if sys.argv[1] == "clean":
    a.close()
    print("closed", flush=True)
time.sleep(60)
"""


def _start(how: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, how], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def _reapers(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"reaper.py {pid}$"], capture_output=True, text=True).stdout
    return out.split()


def test_a_killed_owners_segments_are_unlinked_at_once():
    p, path = _start("kill")
    try:
        assert os.path.exists(path) and _reapers(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 3
        while glob.glob(f"/dev/shm/moeflow-{p.pid}-*") or _reapers(p.pid):
            assert time.monotonic() < deadline, glob.glob(f"/dev/shm/moeflow-{p.pid}-*")
            time.sleep(0.05)
    finally:
        p.kill()


def test_a_clean_owner_leaves_its_reaper_nothing_and_the_reaper_goes_with_it():
    p, path = _start("clean")
    try:
        assert p.stdout.readline().strip() == "closed" and not os.path.exists(path)
        p.terminate()
        p.wait(10)
        deadline = time.monotonic() + 3
        while _reapers(p.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.kill()
