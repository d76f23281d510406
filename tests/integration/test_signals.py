"""Every entry point releases its workers and shared memory on SIGTERM, SIGINT and SIGHUP.

Each case starts one entry point as a subprocess on the embedded ``tiny`` model, waits until it is
running (its deployment's workers are up), sends one signal, and asserts that within a timeout the
process has exited (by the orderly path: ``128 + signum``, not killed by the signal), none of its
descendants is left and no /dev/shm segment of any of them remains.

The full product (7 entry points x 3 signals) would take many minutes on two cores, so each entry
point gets one signal, and every signal reaches at least two entry points:

    generate (dep dp=1) SIGHUP        bench serve (dep dp=2: the reported leak) SIGTERM
    bench prefill (asap stream) SIGINT profile (in its stage profile, before any engine) SIGTERM
    serve (dep dp=1) SIGHUP           a script using LLM, never closed: SIGTERM and SIGINT
    demo (its server is a grandchild: asap D=1 E=1) SIGINT

Every case with a deployment also plants a segment named for a dead pid before it starts and
checks that the start reclaimed it (``comm.segment.reclaim_stale``). Last, a SIGKILL of the engine
itself (no exit path runs) with a worker stopped: the workers and their fork server still go.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from process_tree import default_signals, descendants, is_alive


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 240.0  # the machine may be shared with a benchmark
EXIT_TIMEOUT_S = 60.0
DEPLOYMENT_READY = "workers ready"  # moeflow.workers.launch's debug line once a deployment is up

SCRIPT = """
from moeflow import LLM, SamplingParams
llm = LLM("tiny", mode="dep", dp=1, max_batch_tokens=512, num_kv_blocks=256)  # never closed: the exit path must
print("script: ready", flush=True)
while True:
    llm.generate(["hello"], SamplingParams(max_tokens=32, ignore_eos=True))
"""

_MOEFLOW = [sys.executable, "-m", "moeflow"]
_DEP = ["--model", "tiny", "--mode", "dep", "--max-batch-tokens", "512", "--num-kv-blocks", "256"]  # small: quick
# name -> (command, signal, the log line after which it is mid-run, whether a deployment runs in its tree)
CASES = {
    "generate": (_MOEFLOW + ["generate", *_DEP, "--dp", "1", "--prompt", "hi", "--max-tokens", "3000", "--ignore-eos"],
                 signal.SIGHUP, DEPLOYMENT_READY, True),
    "bench-serve": (_MOEFLOW + ["bench", "serve", *_DEP, "--dp", "2", "--workload", "fixed", "--fixed-len", "16",
                                "--request-rate", "2", "--duration-s", "120", "--no-progress"],
                    signal.SIGTERM, DEPLOYMENT_READY, True),
    "bench-prefill": (_MOEFLOW + ["bench", "prefill", "--model", "tiny", "--mode", "asap", "--attn-dp", "1",
                                  "--moe-workers", "1", "--repeats", "5"],
                      signal.SIGINT, DEPLOYMENT_READY, True),
    "profile": (_MOEFLOW + ["profile", "--model", "tiny", "--json", "{tmp}/profile.json"],
                signal.SIGTERM, "moeflow.hardware", False),
    "serve": (_MOEFLOW + ["serve", *_DEP, "--dp", "1", "--port", "0"], signal.SIGHUP, "moeflow: serving", True),
    "script-term": ([sys.executable, "-c", SCRIPT], signal.SIGTERM, "script: ready", True),
    "script-int": ([sys.executable, "-c", SCRIPT], signal.SIGINT, "script: ready", True),
    "demo": (_MOEFLOW + ["demo", "--request-rate", "1", "--num-prompts", "40", "--out-dir", "{tmp}/demo"],
             signal.SIGINT, "is up at", True),
}


def _segments(pids: set[int]) -> list[str]:
    return sorted(p for pid in pids for p in glob.glob(f"/dev/shm/moeflow-{pid}-*"))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# make test: one case of every signal and a command without a deployment; the rest: make test-slow
_SLOW = {"bench-serve", "bench-prefill", "script-term", "demo"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW else c for c in sorted(CASES)])
def test_signal_releases_everything(case, tmp_path):
    cmd, sig, ready_line, has_deployment = CASES[case]
    cmd = [c.replace("{tmp}", str(tmp_path)) for c in cmd]
    stale = f"/dev/shm/moeflow-{_dead_pid()}-stale{os.getpid()}.dispatch0"
    if has_deployment:
        with open(stale, "wb") as f:
            f.write(b"\0" * 4096)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOEFLOW_LOGGING_LEVEL": "DEBUG", "PYTHONPATH": REPO,
           # NOTE: the decode kernel's first build takes minutes; these tests are about the exit path
           "MOEFLOW_PAGED_ATTENTION": "gather"}
    log_path = tmp_path / "out.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=default_signals, start_new_session=True)
    tree: set[int] = set()
    try:
        while ready_line not in log_path.read_text():
            assert proc.poll() is None, f"{case} exited with {proc.returncode} before it was running:\n" \
                                        f"{log_path.read_text()}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"{case} not running:\n{log_path.read_text()}"
            time.sleep(0.1)
        time.sleep(1.0)  # into the run
        tree = {proc.pid} | descendants(proc.pid)
        if has_deployment:
            assert _segments(tree), f"{case}: no segment of its deployment in /dev/shm"
            assert not os.path.exists(stale), f"{case}: the dead deployment's segment was not reclaimed"
        t_signal = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        deadline = time.monotonic() + 15.0
        while any(is_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        t_exit = time.monotonic() - t_signal
        out = log_path.read_text()
        if sig == signal.SIGINT:  # KeyboardInterrupt: exits 130, or re-raises SIGINT after unwinding
            assert rc in (130, -signal.SIGINT), f"{case}: exit code {rc}\n{out}"
        else:  # killed by SIGTERM/SIGHUP itself (-signum) would mean nothing was cleaned up
            assert rc == 128 + sig, f"{case}: exit code {rc}\n{out}"
        assert not [p for p in tree if is_alive(p)], f"{case}: processes left\n{out}"
        assert _segments(tree) == [], f"{case}: segments left\n{out}"
        print(f"{case}: running after {t_signal - t0:.1f} s, {sig.name} -> everything released in {t_exit:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in tree:
            if is_alive(p):
                os.kill(p, signal.SIGKILL)
        for path in _segments(tree) + [stale]:
            if os.path.exists(path):
                os.unlink(path)


KILLED = """
import time
from moeflow import LLM
llm = LLM("tiny", mode="dep", dp=2, max_batch_tokens=512, num_kv_blocks=256)
print("script: ready", flush=True)
time.sleep(600)
"""


def test_a_killed_engine_takes_its_workers_and_their_fork_server_along(tmp_path):
    """SIGKILL of the engine process (no exit path runs) with one worker stopped, so that it never
    reads its control pipe again: the fork server and both workers are gone within seconds."""
    from moeflow.bench.server_process import children

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "MOEFLOW_PAGED_ATTENTION": "gather"}
    log_path = tmp_path / "out.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", KILLED], cwd=tmp_path, env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=default_signals, start_new_session=True)
    tree: set[int] = set()
    try:
        t0 = time.monotonic()
        while "script: ready" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() - t0 < START_TIMEOUT_S, log_path.read_text()
            time.sleep(0.1)
        workers = [p for p, role in children(proc.pid).items() if role == "worker"]
        tree = descendants(proc.pid)
        assert len(workers) == 2, (children(proc.pid), log_path.read_text())
        os.kill(workers[0], signal.SIGSTOP)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10.0
        while any(is_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in tree if is_alive(p)], f"processes left after the engine was killed: {tree}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in tree:
            if is_alive(p):
                os.kill(p, signal.SIGKILL)
        for path in _segments(tree | {proc.pid}):  # the killed engine could not unlink its own
            os.unlink(path)
