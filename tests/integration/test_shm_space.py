"""A /dev/shm too small for a deployment: the start is refused with the bytes needed, the bytes free
and the mount, before any worker runs, and nothing is left behind; a segment created past the
up-front check (another process filled the mount meanwhile) fails the same way instead of
SIGBUS. Runs in a private mount namespace with a 16 MiB tmpfs on /dev/shm (needs root and
``unshare``; skipped otherwise, saying why)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import glob, os, sys
from moeflow import LLM
from moeflow.comm.segment import Segment
from moeflow.comm.space import ShmSpaceError

with open("/dev/shm/filler", "wb") as f:  # another program's 10 MiB: 6 MiB stay free
    f.write(b"x" * (10 << 20))
try:
    LLM(sys.argv[1], dtype="float32", mode="asap", moe_workers=1, max_batch_tokens=8192)
    print("STARTED")
except ShmSpaceError as e:
    print("REFUSED", e)
print("LEFT", sorted(glob.glob("/dev/shm/moeflow-*")))
try:
    Segment.create("/dev/shm/moeflow-test.big", 8 << 20, lambda buf: None)
    print("CREATED")
except ShmSpaceError as e:
    print("SEGMENT", e)
print("LEFT", sorted(glob.glob("/dev/shm/moeflow-*")))
"""


def test_a_full_dev_shm_is_refused_at_start_with_the_numbers(checkpoints):
    mount = "mount -t tmpfs -o size=16m tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs (needs root and unshare): {probe.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'{mount} && exec "$0" -c "$1" "$2"', sys.executable, _SCRIPT, checkpoints("qwen3").path],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    refused = lines["REFUSED"]  # asap D1 E1's two mailboxes: 2 x 8 MiB at 8192 tokens of float32 rows
    assert "/dev/shm has 6291456 bytes (6.0 MiB) free" in refused, log
    assert "needs 16" in refused and "tmpfs mounted on /dev/shm, size 16 MiB" in refused, log
    assert "moeflow-test.big needs 8388608 bytes" in lines["SEGMENT"], log
    assert out.stdout.count("LEFT []") == 2, log  # no segment, no temporary file
