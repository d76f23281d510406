"""``moeflow serve`` in a subprocess on a free port, for the commands that drive a real server over
HTTP (the demo, the soak): started, waited on until /health answers 200, and stopped on exit; and
what it looks like from outside (its worker processes, their memory and descriptors, its /dev/shm),
read from /proc as the soak samples it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

START_TIMEOUT_S = 180.0


class ServeProcess:
    """``moeflow serve`` in a subprocess on a free port; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, model: str, flags: list[str], log_path: str):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [sys.executable, "-m", "moeflow", "serve", "--model", model, "--port", str(self.port),
                    "--log-level", "warning", *flags]
        self.log_path = log_path

    def __enter__(self) -> str:
        import httpx

        self._log = open(self.log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per process, as the engine assumes
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(self.cmd)} exited with {self.proc.returncode}; see {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        return url
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server was not healthy within {START_TIMEOUT_S:g} s; see {self.log_path}")
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: the server releases workers and shared memory
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _child_processes(pid: int) -> dict[int, bytes]:
    """Direct children of ``pid`` and their command lines (Linux's /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read()
        except OSError:
            continue
    return out


def children(pid: int) -> dict[int, str]:
    """The processes ``pid`` started: "worker" (a deployment's; the fork server's children) or
    "other" (the fork server itself, multiprocessing's tracker)."""
    out = {}
    for child, cmdline in _child_processes(pid).items():
        out[child] = "worker" if b"spawn_main" in cmdline else "other"
        if b"multiprocessing.forkserver" in cmdline:
            out.update({w: "worker" for w in _child_processes(child)})
    return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_usage(server: int) -> dict:
    """The server's /dev/shm segments: bytes resident, files, deployments."""
    prefix = f"moeflow-{server}-"
    names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    size = 0
    for n in names:
        try:
            size += os.stat(os.path.join("/dev/shm", n)).st_blocks * 512
        except OSError:
            pass
    return {"mb": size / 2**20, "files": len(names), "deployments": len({n.split(".")[0] for n in names})}


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
