"""Workers are forked by one fork server per engine process (``workers/fork_server.py``); what a
spawned worker got from the engine at its start it still gets: here, the engine's stdout and
stderr as they are then, not as they were when the server started."""
from __future__ import annotations

import os

from moeflow import LLM


def test_a_worker_writes_where_the_engine_writes_at_its_start(tmp_path):
    with LLM("tiny", mode="dep", dp=1, dtype="float32", num_kv_blocks=64):
        pass  # the fork server is up now, with the descriptors of this moment
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            with LLM("tiny", mode="dep", dp=1, dtype="float32", num_kv_blocks=64) as llm:
                pids = [w.process.pid for w in llm.engine.deployment.workers]
                got = [(os.readlink(f"/proc/{p}/fd/1"), os.readlink(f"/proc/{p}/fd/2")) for p in pids]
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    assert got == [(str(out), str(err))] * len(pids)
