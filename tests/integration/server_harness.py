"""A real ``moeflow serve`` in a subprocess on a free port, for the server tests (real HTTP)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from moeflow.bench.server_process import children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``model``: a checkpoint for ``moeflow serve``; None: ``moeflow router`` (``args`` name its servers).
    ``host``: the network namespace's ``netns.Host`` to run it in (None: here, on loopback)."""

    def __init__(self, model: str | None, *args: str, log_path: str, start_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None, host=None):
        self.port = free_port()  # a namespace of its own has every port free
        addr = "127.0.0.1" if host is None else host.addr
        self.url = f"http://{addr}:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        command = ["serve", "--model", model] if model is not None else ["router"]
        cmd = [sys.executable, "-m", "moeflow", *command, "--host", addr, "--port", str(self.port),
               "--log-level", "warning", *args]
        if host is not None:
            cmd = host.command(*cmd)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the server was not healthy within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """The unlabelled samples of /metrics plus ``name{labels}`` for labelled ones."""
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def worker_pids(self) -> list[int]:
        """Worker processes of the deployment (multiprocessing's spawned children of the server)."""
        return [pid for pid, role in children(self.proc.pid).items() if role == "worker"]

    def stop(self) -> int:
        """SIGTERM (a graceful stop that releases workers and shared memory); SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
