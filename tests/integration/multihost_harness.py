"""Helpers of the multi-host tests: a ``moeflow worker-node`` started in a namespace "host", and the
worker processes it spawned."""
from __future__ import annotations

import os
import subprocess
import sys

from moeflow.bench.server_process import children

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_node(host, master_addr: str, port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    penv = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    penv.pop("GLOO_SOCKET_IFNAME", None)
    return subprocess.Popen(host.command(sys.executable, "-m", "moeflow", "worker-node", "--nnodes", "2", "--node-rank",
                                         "1", "--master-addr", master_addr, "--master-port", str(port), env=env),
                            env=penv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def worker_children(pid: int) -> list[int]:
    """The worker processes a worker node started (its fork server's children)."""
    return [p for p, role in children(pid).items() if role == "worker"]
