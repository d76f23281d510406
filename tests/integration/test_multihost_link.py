"""docs/results/multihost/link.py (run.sh runs it across two network namespaces) runs here with
both ranks on loopback and writes the rows multihost.md's link table reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from server_harness import free_port

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
LINK = os.path.join(ROOT, "docs", "results", "multihost", "link.py")


def test_the_link_probe_measures_every_size_over_gloo(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    out = tmp_path / "link.json"
    peer = subprocess.Popen([sys.executable, LINK, "1", init, os.devnull], env=env)
    try:
        subprocess.run([sys.executable, LINK, "0", init, str(out)], env=env, check=True, timeout=120,
                       capture_output=True)
        assert peer.wait(timeout=60) == 0
    finally:
        peer.kill()
    d = json.loads(out.read_text())
    assert d["provenance"]["commit"] and [r["rows"] for r in d["rows"]] == [1, 64, 1024, 4096]
    assert all(r["rtt_us"] > 0 and r["bytes"] == r["rows"] * d["hidden"] * 2 for r in d["rows"])
