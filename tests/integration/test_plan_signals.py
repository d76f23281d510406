"""SIGTERM stops ``moeflow plan`` mid-search, its worker processes with it, within 5 s.

The search once unwound into ``Pool.join`` on SIGTERM while its workers kept computing (minutes).
Each case starts a search of DeepSeek-R1 on 16 GB200 (minutes of simulation), waits until its first
side simulation has ended (the workers are busy with the next ones), sends SIGTERM to the command
alone, not its process group, and asserts that the command exits by the orderly path (143) and that
it and every descendant (workers, multiprocessing's resource tracker) are gone within 5 s.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from process_tree import default_signals, descendants, is_alive

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_S = 5.0
START_TIMEOUT_S = 300.0  # the machine may be shared
PLAN = [sys.executable, "-m", "moeflow", "plan", "--model", "deepseek-r1", "--hardware", "gb200", "--devices", "16",
        "--isl", "8192", "--osl", "1024", "--ttft-s", "5", "--tpot-ms", "50"]


@pytest.mark.parametrize("jobs", [2, 1])
def test_sigterm_stops_the_search_and_its_workers_within_5_s(jobs, tmp_path):
    log_path = tmp_path / "err.log"
    env = {**os.environ, "PYTHONPATH": REPO}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(PLAN + ["--jobs", str(jobs)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=log, preexec_fn=default_signals, start_new_session=True)
    tree: set[int] = set()
    try:
        t0 = time.monotonic()
        while "sides 1/" not in log_path.read_text():
            assert proc.poll() is None, f"plan exited with {proc.returncode} before it was searching:\n" \
                                        f"{log_path.read_text()}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"no side simulated:\n{log_path.read_text()}"
            time.sleep(0.1)
        tree = {proc.pid} | descendants(proc.pid)
        if jobs > 1:
            assert len(tree) >= 1 + jobs, f"expected {jobs} workers under {proc.pid}: {tree}"
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=STOP_S)
        while any(is_alive(p) for p in tree) and time.monotonic() - t_signal < STOP_S:
            time.sleep(0.02)
        t_stop = time.monotonic() - t_signal
        left = [p for p in tree if is_alive(p)]
        assert rc == 128 + signal.SIGTERM, f"exit code {rc}\n{log_path.read_text()}"
        assert not left, f"still running {STOP_S} s after SIGTERM: {left}\n{log_path.read_text()}"
        print(f"jobs {jobs}: SIGTERM after {t_signal - t0:.1f} s, everything gone in {t_stop:.2f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in tree:
            if is_alive(p):
                os.kill(p, signal.SIGKILL)
